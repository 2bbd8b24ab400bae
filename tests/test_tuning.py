"""Tilings ranked by the compiler (``codegen explain VARIANT --compiled --rank``): the candidates a spec's
``tuning`` section asks for, why an illegal one is left out, and a ranking compiled by libtpu."""

from __future__ import annotations


from codegen import cli, compiled, load, pipeline, tuning
from tests.spec_cases import SPEC_PATH, edited, family

PRODUCTION = "tpu_sm_bf16_q256_w2048c512f256_hcall"


def test_candidates_are_the_variant_at_every_tuning_tiling_and_head_chunk():
    fam = family()
    tuned, found = tuning.candidates(fam, PRODUCTION)
    spec = fam.spec.tuning
    assert len(found) == len(spec.tilings) * len(spec.head_chunk)
    assert {c.name for c in found if not c.error} == {p.name for p in tuned.plans}
    assert PRODUCTION in {p.name for p in tuned.plans}  # the variant's own tiling competes
    # a candidate the chips' VMEM cannot hold is named with the budget's rule, not compiled
    assert all("of VMEM" in c.error for c in found if c.error)
    assert tuned.spec.family == "csa_v4_tuning"
    own = fam.plan(PRODUCTION).variant
    for p in tuned.plans:  # only the tiling and head chunk differ from the variant's
        assert (p.variant.q_layout, p.variant.dtype, p.variant.backward) == (
            own.q_layout,
            own.dtype,
            own.backward,
        )
        assert p.name == next(
            c.name for c in found if (c.tiling, c.head_chunk) == (p.variant.tiling, p.head_chunk)
        )


def test_an_illegal_candidate_is_named_with_its_rule_and_the_rest_still_rank():
    def edit(data):
        data["tuning"]["head_chunk"] = [0, 24]  # 24 does not divide the model's 64 heads

    fam = pipeline.build(load.parse(edited(edit), "spec.yaml"), "spec.yaml")
    tuned, found = tuning.candidates(fam, PRODUCTION)
    bad = [c for c in found if c.head_chunk == 24]
    assert len(bad) == len(fam.spec.tuning.tilings)
    assert all(c.error and "head_chunk" in c.error and "24" in c.error for c in bad), bad[0].error
    assert {p.head_chunk for p in tuned.plans} == {0}


def test_rank_needs_compiled_and_one_variant(capsys):
    argv = ["explain", str(SPEC_PATH), "--shape", "1,64,8192,128,2048", "--rank"]
    assert cli.main([*argv[:2], PRODUCTION, *argv[2:]]) == 2
    assert "--rank needs --compiled" in capsys.readouterr().err
    assert cli.main([*argv, "--compiled"]) == 2
    assert "--rank ranks the tilings of one variant" in capsys.readouterr().err
    assert cli.main([*argv[:2], PRODUCTION, *argv[2:4], "--chip", "v6e,7x"]) == 2
    assert "several need --compiled" in capsys.readouterr().err


def test_a_ranking_compiles_the_scratch_candidates_as_the_committed_variant_compiles():
    """A small candidate set on v5e at a small shape: the candidate that is the committed variant costs, from
    its scratch package, exactly what the committed package costs; the ranking is sorted and its own best
    is x 1.00."""
    variant, shape = "tpu_hm_f32_q16_w128_hcall", (1, 8, 256, 128, 256)

    def edit(data):
        data["tuning"] = {"tilings": ["small"], "head_chunk": [0, 4]}

    fam = pipeline.build(load.parse(edited(edit), "spec.yaml"), "spec.yaml")
    ranked, found = tuning.rank(fam, variant, ["v5e"], shape, "causal")
    assert [r.error for r in ranked] == ["", ""] and not any(c.error for c in found)
    # W 256 takes two 128-wide w tiles: the split backward
    assert ranked[0].total <= ranked[1].total and set(ranked[0].cycles) == {"forward", "dq_dweights", "dk"}
    rows = compiled.explain(
        "generated.csa_v4", [family().plan(variant)], ["v5e"], shape, 4, masks=("causal",)
    )
    committed = {r.kernel: r.report.cycles for r in rows if r.ok and r.kernel != compiled.XLA}
    assert next(r for r in ranked if r.variant == variant).cycles == committed
    text = tuning.table(ranked, found, fam, variant, shape, "causal")
    assert (
        "small*" in text
        and "1.00" in text
        and f"across the chips: small with head_chunk {ranked[0].head_chunk or 'all'}" in text
    )


def test_compiled_explain_costs_the_topk_selection_once_per_block_of_rows():
    """score_topk's selection kernel runs once per query chunk, a step per 128 rows: its report sums
    the steps over the chunks the family's own rule makes (2 at S = 8192, W = 4096 with the default
    512 MiB), each costed at the trips its rows' visible span gives the loops."""
    plan = pipeline.load_family(SPEC_PATH).plan(PRODUCTION)
    assert compiled._topk_chunks("generated.csa_v4", "", (1, 64, 8192, 128, 4096), plan) == 2
    shape = (1, 8, 512, 128, 256)
    rows = compiled.explain(
        "generated.csa_v4",
        [plan],
        ["v6e"],
        shape,
        4,
        masks=("unmasked", "causal"),
        programs=("topk",),
        top_k=16,
    )
    assert {r.kernel for r in rows} == {"forward", "topk_select", compiled.XLA} and all(r.ok for r in rows)
    select = {r.mask: r.report for r in rows if r.kernel == "topk_select"}
    # the rest of the selection, XLA's programs (the transposes), read too: one chunk, no loop around them
    xla = next(r.report for r in rows if r.kernel == compiled.XLA)
    assert xla.steps == 1 and xla.cycles >= xla.bundles > 0 and xla.executed == 0
    # bfloat16 scores: an 8-trip loop of counting passes (two bits each); one chunk of 4 blocks of 128 rows
    trips = [trips for _, trips in select["unmasked"].loops]
    assert trips.count(8) == 1 and 16 not in trips and select["unmasked"].steps == 512 // 128
    full = select["unmasked"]
    assert full.steps * full.executed <= full.cycles < (full.steps + 3) * full.executed
    # causal rows see fewer blocks: the early blocks' passes are shorter
    assert select["causal"].cycles < full.cycles
