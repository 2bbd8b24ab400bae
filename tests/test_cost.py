"""The cost model read off the kernel plan, against hand arithmetic; and the plan against what the
generated kernels really do: their index maps walked grid point by grid point, their cost estimates."""

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.state.discharge import discharge_state

from codegen import chips, cost, plan
from codegen.shipped import _geometry as geometry
from codegen.spec import DtypePolicy
from generated.csa_v4 import VARIANTS
from tests import support
from tests.spec_cases import ROOT, family

MIB = 1024 * 1024
SM_F32 = family().plan("tpu_sm_f32_q16_w128_hcall")
# A 128 x 1024 tiling with one compute block per tile (the spec's q128w1024 candidate), hand-costed below.
HM_BF16 = plan.build(
    dataclasses.replace(
        family().plan("tpu_hm_bf16_q256_w2048c512f256_hc16").variant,
        tiling="q128w1024",
        tiles=family().spec.tilings["q128w1024"],
    )
)


def _replan(base, **changes):
    """The plan of ``base``'s variant with ``changes`` (a variant the shipped spec does not emit)."""
    return plan.build(dataclasses.replace(base.variant, **changes))


def _by_kernel(variant, shape):
    return {c.kernel: c for c in cost.variant_costs(variant, shape)}


def test_seq_major_f32_small():
    # B=1, H=2, S=32, D=128, W=256. All f32: row granule 8, so bq = min(16, 32) = 16,
    # bw = min(128, 256) = 128; nq = 2, nw = 2, head_chunk 0: hc = H = 2 and no chunk axis.
    # Blocks (bytes): q [16, 2, 128] 16384 (VMEM: each query's [2, 128] padded to a tile of 8 rows, 65536);
    # k [128, 128] 65536; weights [16, 2] 128 (VMEM: [16, 128] 8192); kv_bounds [16, 2] int32 128 (VMEM
    # 8192); out / g tile [16, 128] 8192.
    costs = _by_kernel(SM_F32, (1, 2, 32, 128, 256))
    fwd, dq, dk = costs["forward"], costs["dq_dweights"], costs["dk"]
    # Forward grid (b, i, j) = (1, 2, 2). q, weights follow i: 2 fetches; k follows j (innermost): 4; kv 2;
    # out (i, j): 4 writes. HBM 2*16384 + 4*65536 + 2*128 + 2*128 + 4*8192 = 328192.
    assert fwd.grid == (1, 2, 2)
    assert fwd.fetches == {"q": 2, "k": 4, "weights": 2, "kv_bounds": 2, "out": 4}
    assert fwd.hbm_bytes == 328192
    # Min: q 32*2*128*4 = 32768, k 256*128*4 = 131072, weights 32*2*4 = 256, kv 256, out 32*256*4 = 32768.
    assert fwd.min_hbm_bytes == 197120
    # VMEM: 2 * (65536 + 65536 + 8192 + 8192 + 8192) = 311296, no chunk accumulator; the stacked q
    # [2 * 16, 128] f32 16384, 2 f32 tiles 2*8192, and at HIGHEST the logits [2, 16, 128] f32 16384.
    assert fwd.vmem_bytes == 311296 + 16384 + 2 * 8192 + 16384
    # FLOPs: 2*B*H*S*W*D = 2*2*32*256*128 = 4194304, plus 3*H*S*W = 49152 elementwise (useful), and
    # the mask, 6 ops on each of the S*W = 8192 entries of the 4 compute blocks with work: 49152.
    assert (fwd.flops, fwd.mxu_flops, fwd.useful_flops) == (4243456 + 49152, 4194304, 4243456)

    # dq_dweights grid (b, i, j) = (1, 2, 2): as forward, plus g 4 reads, dq 2 and dweights 2 writes.
    # HBM 328192 - 8192*4 (no out) + 4*8192 (g) + 2*16384 (dq) + 2*128 (dweights) = 361216.
    assert dq.grid == (1, 2, 2)
    assert dq.fetches == {"q": 2, "k": 4, "weights": 2, "kv_bounds": 2, "g": 4, "dq": 2, "dweights": 2}
    assert dq.hbm_bytes == 361216
    assert dq.min_hbm_bytes == 197120 + 32768 + 256  # + dq + dweights
    # VMEM: 2 * (155648 inputs + 65536 dq + 8192 dweights) = 458752; the accumulator of u, f32 [16, 2, 128]
    # 65536 (padded as q); a head group's stacked q, logits and dlogits [2 * 16, 128] f32 3 * 16384, the
    # cotangent tile 8192. Total 581632.
    assert dq.vmem_bytes == 458752 + 65536 + 3 * 16384 + 8192
    # f32: one pass per matmul; the cotangent is exact, so dq and dweights come from one matmul and only
    # the relu' select is per entry. 2 * 4194304 + 1*2*32*256 = 8388608 + 16384, and the mask 49152.
    # Once per q block, on the summed [rows, D] (B*S*H*D = 8192 entries): 4 elementwise, and no MXU work
    # (sequence-major stacking has each query's weights along sublanes: no one-hot broadcast).
    assert (dq.flops, dq.mxu_flops) == (8404992 + 49152 + 8192 * 4, 8388608)

    # dk reads what dq does. Grid (b, j, i) = (1, 2, 2): q, weights, kv_bounds, g follow i
    # (innermost): 4 each; k and dk follow j: 2.
    # HBM 4*16384 + 2*65536 + 4*128 + 4*128 + 4*8192 + 2*65536 = 361472.
    assert dk.grid == (1, 2, 2)
    assert dk.fetches == {"q": 4, "k": 2, "weights": 4, "kv_bounds": 4, "g": 4, "dk": 2}
    assert dk.hbm_bytes == 361472
    # VMEM: 2 * (65536 + 65536 + 8192 + 8192 + 8192 + 65536 dk) = 442368; accumulator [128, 128] f32
    # 65536; as dq, a head group's stacked q, logits, dlogits 3 * 16384 and the cotangent 8192.
    assert dk.vmem_bytes == 442368 + 65536 + 3 * 16384 + 8192
    # the dlogits select and multiply, 2 * 16384, and the mask 49152
    assert (dk.flops, dk.mxu_flops) == (8388608 + 2 * 16384 + 49152, 8388608)


def test_head_major_bf16_chunked():
    # B=1, H=32, S=256, D=128, W=2048. bf16 rows granule 16: bq = 128, bw = 1024; nq = 2, nw = 2,
    # hc = 16, nc = 2. Blocks: q [16, 128, 128] bf16 524288; k [1024, 128] 262144; weights [128, 16] 4096
    # (VMEM [128, 128] bf16 32768); kv [128, 2] int32 1024 (VMEM 65536); tile [128, 1024] bf16 262144.
    costs = _by_kernel(HM_BF16, (1, 32, 256, 128, 2048))
    fwd, dq, dk = costs["forward"], costs["dq_dweights"], costs["dk"]
    # The forward holds every head of the q block (a chunk per matmul): q [32, 128, 128] bf16 1048576,
    # weights [2 chunks, 128, 16] 8192 (VMEM [2, 128, 128] bf16 65536).
    assert fwd.blocks["q_all_heads"] == (32, 128, 128) and fwd.blocks["weights_all_heads"] == (2, 128, 16)
    # Forward grid (b, i, j) = (1, 2, 2): q, weights follow i: 2; k, out follow j (innermost): 4; kv 2.
    # HBM 2*1048576 + 4*262144 + 2*8192 + 2*1024 + 4*262144 = 4212736 (a grid step per chunk read q
    # per w tile: 8 chunk blocks, 6326272 in all).
    assert fwd.grid == (1, 2, 2)
    assert fwd.fetches == {"q_all_heads": 2, "k": 4, "weights_all_heads": 2, "kv_bounds": 2, "out": 4}
    assert fwd.hbm_bytes == 4212736
    # Min: q 32*256*128*2 = 2097152, k 524288, weights 16384, kv 2048, out 256*2048*2 = 1048576.
    assert fwd.min_hbm_bytes == 3688448
    # VMEM: 2 * (1048576 + 262144 + 65536 + 65536 + 262144) = 3407872, no scratch; a chunk's stacked q
    # [16 * 128, 128] bf16 524288; 3 f32 tiles of one compute block (the whole tile) [128, 1024]: the
    # chunk's head sum, the running sum over chunks, the scores: 3 * 524288; a head group's float32
    # logits between the matmul and the head sum, [16, 128, 1024] 8388608.
    assert fwd.vmem_bytes == 3407872 + 524288 + 3 * 524288 + 8388608
    assert fwd.vmem_bytes_unpadded == 2 * (1048576 + 262144 + 8192 + 1024 + 262144) + 4 * 524288 + 8388608
    # 2*32*256*2048*128 = 2**32 matmul, 3*32*256*2048 = 3 * 2**24 elementwise, the mask once on
    # 256*2048 entries: 6 * 2**19.
    assert (fwd.flops, fwd.mxu_flops) == (2**32 + 3 * 2**24 + 6 * 2**19, 2**32)

    # dq_dweights grid (b, i, c, j) = (1, 2, 2, 2): q, weights, dq, dweights follow c: 4; k, g follow j
    # (innermost): 8; kv 2. HBM 4*524288*2 + 8*262144*2 + 4*4096*2 + 2*1024 = 8423424.
    assert dq.grid == (1, 2, 2, 2)
    assert dq.hbm_bytes == 8423424
    assert dq.min_hbm_bytes == 2097152 + 524288 + 16384 + 2048 + 1048576 + 2097152 + 16384
    # VMEM: 2 * (1146880 inputs + 524288 dq + 32768 dweights) = 3407872; f32 accumulator of u 1048576;
    # a head group (16): stacked q [16 * 128, 128] bf16 524288, logits [16, 128, 1024] f32 8388608, the
    # masked cotangent in bf16 4194304 (exact: a bf16 score's cotangent, so one pass, the weights
    # after); the cotangent [128, 1024] f32 524288.
    assert dq.vmem_bytes == 3407872 + 1048576 + 524288 + 8388608 + 4194304 + 524288
    # bf16: the dq matmul is one exact pass, dweights from its result: 2 * 2**32 MXU, 2**24 elementwise
    # (the relu' select), the mask per head chunk: 2 * 6 * 2**19; once per q block and chunk on the
    # summed [rows, D] (B*S*H*D = 2**20 entries): the weights' one-hot broadcast, 2 * 16 FLOPs per
    # entry (16 heads a step), and 4 elementwise.
    assert (dq.flops, dq.mxu_flops, dq.useful_flops) == (
        2 * 2**32 + 2**24 + 12 * 2**19 + 2**20 * (32 + 4),
        2 * 2**32 + 2**20 * 32,
        2 * 2**32 + 2**24,
    )

    # dk reads what dq does. Grid (b, j, i, c) = (1, 2, 2, 2): q, weights follow c: 8; kv_bounds,
    # g follow i: 4; k, dk follow j: 2.
    # HBM 8*524288 + 2*262144 + 8*4096 + 4*1024 + 4*262144 + 2*262144 = 6328320.
    assert dk.grid == (1, 2, 2, 2)
    assert dk.fetches == {"q": 8, "k": 2, "weights": 8, "kv_bounds": 4, "g": 4, "dk": 2}
    assert dk.hbm_bytes == 6328320
    assert dk.min_hbm_bytes == 2097152 + 524288 + 16384 + 2048 + 1048576 + 524288
    # VMEM: 2 * (524288 + 262144 + 32768 + 65536 + 262144 + 262144 dk) = 2818048; f32 [1024, 128]
    # accumulator 524288; the head group's temporaries as dq's: 17825792.
    assert dk.vmem_bytes == 2818048 + 524288 + 524288 + 8388608 + 2 * 4194304 + 524288
    assert (dk.flops, dk.mxu_flops) == (3 * 2**32 + 2 * 2**24 + 12 * 2**19, 3 * 2**32)


def test_padding_and_shrinking():
    # kv_bounds [128, 2] int32 occupies 128 x 128 lanes; a bf16 [8, 16] block pads to 16 rows.
    assert cost.padded_bytes((128, 2), 4) == 128 * 128 * 4
    assert cost.padded_bytes((8, 16), 2) == 16 * 128 * 2
    # S=40, W=300 on the q16/w128 f32 variant: bq 16, bw 128; S_pad 48, W_pad 384 are executed, not useful.
    [fwd, *_] = cost.variant_costs(SM_F32, (1, 2, 40, 128, 300))
    assert fwd.grid == (1, 3, 3)
    assert fwd.mxu_flops == 2 * 2 * 48 * 384 * 128
    assert fwd.useful_flops == 2 * 40 * 300 * (2 * 128 + 3)
    assert fwd.min_hbm_bytes == 4 * (40 * 2 * 128 + 300 * 128 + 40 * 2 + 40 * 2 + 40 * 300)


def _brute_force_fetches(grid, block_index):
    """DMAs of a block in a row-major walk of ``grid`` that fetches whenever the block index changes."""
    indices = [block_index(point) for point in itertools.product(*map(range, grid))]
    return 1 + sum(a != b for a, b in zip(indices, indices[1:]))


@pytest.mark.parametrize("grid", [(1, 3, 2, 4), (2, 1, 3, 1), (3, 2, 1, 2), (2, 2, 2, 2, 3), (1, 1, 1)])
def test_block_fetches_matches_brute_force(grid):
    for r in range(len(grid) + 1):
        for axes in itertools.combinations(range(len(grid)), r):
            expected = _brute_force_fetches(grid, lambda point: tuple(point[a] for a in axes))
            assert geometry.block_fetches(grid, axes) == expected, (grid, axes)


def _block_indices(block_mapping, grid, prefetch) -> list[tuple[int, ...]]:
    """The block index a generated pallas_call's own index map names at every step of ``grid``, in order.
    The index map reads the scalar-prefetch refs: discharged, it takes and returns arrays."""
    index_map = discharge_state(block_mapping.index_map_jaxpr)
    rank = len(block_mapping.index_map_jaxpr.jaxpr.outvars)
    evaluate = jax.jit(lambda *args: jax.core.eval_jaxpr(index_map.jaxpr, index_map.consts, *args)[:rank])
    return [
        tuple(int(v) for v in evaluate(*point, *prefetch)) for point in itertools.product(*map(range, grid))
    ]


@pytest.mark.parametrize(
    "name",
    [
        "tpu_hm_bf16_q16_w128_hc16",
        "tpu_sm_bf16_q16_w128_hc16",
        "tpu_sm_f32_q16_w128_hcall",
        "tpu_sm_fp8_q256_w2048c512f256_hcall",
    ],
)
def test_fetches_match_a_walk_of_the_real_index_maps(name):
    """Every block's DMA count in the cost model equals a walk of the generated pallas_call's own index
    maps over its whole grid, fetching whenever a block index changes (the Pallas pipeline's rule)."""
    module = VARIANTS[name]
    shape = (2, 32, 300, 128, 2100) if "q128" in name else (2, 32, 40, 128, 300)  # every grid axis moves
    q, k, weights = support.make_inputs(module.VARIANT, shape, seed=0)
    scale = support.key_scale(module.VARIANT, k)

    def loss(q, k, weights):
        return jnp.sum(module.score(q, k, weights, **scale).astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, weights)
    unmasked = jnp.zeros((2, shape[2]), jnp.int32), jnp.full((2, shape[2]), shape[4], jnp.int32)
    x = module.prepare(q, k, weights, *unmasked, scale.get("k_scale"))
    the_plan = family().plan(name)
    walked = 0
    for eqn in support.pallas_calls(jaxpr.jaxpr):
        kernel = the_plan.kernel(support.kernel_name(eqn, name))
        model = cost.kernel_cost(the_plan, kernel, shape)
        mapping = eqn.params["grid_mapping"]
        prefetch = [getattr(x.ranges, n) for n in kernel.scalar_prefetch]
        assert tuple(mapping.grid) == model.grid, kernel.name
        for block, bm in zip(kernel.blocks, mapping.block_mappings):
            indices = _block_indices(bm, model.grid, prefetch)
            fetches = 1 + sum(a != b for a, b in zip(indices, indices[1:]))
            assert fetches == model.fetches[block.name], (kernel.name, block.name)
            walked += 1
    assert walked >= 5 * len(cost.call_kernels(the_plan, shape))  # the forward and the backward this W takes


def test_tiling_matches_generated_modules():
    for the_plan in family().plans:
        module = VARIANTS[the_plan.name]
        for seq_len, num_blocks in [(1, 1), (20, 130), (200, 5000), (8192, 2048)]:
            t = cost.tiling(the_plan, (1, 64, seq_len, 128, num_blocks))
            assert (t.block_q, t.block_w) == module.tiles(seq_len, num_blocks), the_plan.name


def test_vmem_footprints_are_full_tiles():
    assert cost.vmem_footprints(HM_BF16, 32, 128) == {  # see test_head_major_bf16_chunked
        "forward": 3407872 + 524288 + 3 * 524288 + 8388608,
        "dq_dweights": 3407872 + 1048576 + 524288 + 8388608 + 4194304 + 524288,
        "dk": 2818048 + 524288 + 524288 + 8388608 + 2 * 4194304 + 524288,
        # dk's, and dq's blocks [16, 128, 128] bfloat16 and dweights' [128, 16 -> 128], double-buffered, and
        # dq_acc [16, 128, 128] float32
        "dq_dk": 2818048 + 524288 + 524288 + 8388608 + 2 * 4194304 + 524288 + 2 * (524288 + 32768) + 1048576,
    }


def test_chip_facts():
    v6e, v5e, x7, h200 = (chips.get(n) for n in ("v6e", "v5e", "7x", "h200"))
    assert v6e.vmem_bytes == 128 * MIB and v6e.scoped_vmem_default_bytes == 32 * MIB
    assert v5e.scoped_vmem_default_bytes == 16 * MIB and v5e.fp8_flops == 0
    assert v6e.bf16_flops == 920e12 and v6e.hbm_bytes_per_second == 1.64e12
    assert chips.get("v5p").cores == chips.get("v5p").cores_per_device == 2
    # 7x: two TensorCores, each its own device: a kernel gets half the chip.
    assert x7.cores == 2 and x7.device_fraction == 0.5 and x7.sublane_tiling[2] == 16
    assert h200.hbm_bytes_per_second == 4.8e12 and h200.vmem_bytes == 228 * 1024 and h200.cores == 132
    assert set(chips.CHIPS) == {"v5e", "v5p", "v6e", "7x", "h100", "h200"}
    # the compiled-schedule model moves bytes at the rate measured on a v5e, at the cited one elsewhere
    measured = json.loads((ROOT / "benchmarks" / "results" / "v5e_constants.json").read_text())["hbm_copy"]
    assert v5e.model_hbm_bytes_per_second_per_device() == pytest.approx(measured["gb_per_s"] * 1e9, rel=1e-3)
    assert x7.model_hbm_bytes_per_second_per_device() == x7.hbm_bytes_per_second_per_device()
    with pytest.raises(ValueError, match="valid:.*v6e"):
        chips.get("v4")


def test_roofline():
    v6e = chips.get("v6e")
    [fwd, *_] = cost.variant_costs(HM_BF16, (1, 64, 8192, 128, 2048))
    # 2**38 MXU + 3 * 2**30 elementwise FLOPs and the mask's 6 * 2**24 at 920e12/s, against 202440704
    # bytes at 1.64e12 B/s: compute bound. 128 x 1024 tiles: 64 q blocks x 2 w tiles. Every head of a q
    # block, [64, 128, 128] bf16, once per q block: 64 * 2097152; k [1024, 128] and the out tile
    # [128, 1024] bf16 per step: 2 * 128 * 262144; the weights [4, 128, 16] bf16 per q block: 64 * 16384;
    # kv_bounds [128, 2] int32: 64 * 1024.
    vpu = 3 * 2**30 + 6 * 2**24
    assert fwd.roofline_seconds(v6e) == pytest.approx((2**38 + vpu) / 920e12)
    assert fwd.memory_seconds(v6e) == pytest.approx(202440704 / 1.64e12)
    assert fwd.intensity() == pytest.approx((2**38 + vpu) / 202440704)
    # f32 inputs run at 1/6 of the bf16 rate.
    [f32_fwd, *_] = cost.variant_costs(
        family().plan("tpu_hm_f32_q256_w2048c512_hc16"), (1, 64, 8192, 128, 2048)
    )
    assert f32_fwd.compute_seconds(v6e) == pytest.approx(2**38 * 6 / 920e12 + vpu / 920e12)


def test_float8_keys_with_scale():
    # float8 q/k with a per-key float32 scale, bf16 gradients (the spec's float8 policy). B=1, H=32, S=256,
    # D=128, W=2048: float8 rows come in 32s, bq = min(128, 256) = 128; bw 1024; grid as the bf16 case.
    policy = DtypePolicy(qk="float8_e4m3fn", k_scale=True, weights="bfloat16", out="bfloat16")
    fp8 = _replan(HM_BF16, policy=policy)
    costs = _by_kernel(fp8, (1, 32, 256, 128, 2048))
    fwd, dq, dk = costs["forward"], costs["dq_dweights"], costs["dk"]
    # Forward, every head of the q block a step: q [32, 128, 128] 524288 x 2; k [1024, 128] 131072 x 4;
    # weights [2, 128, 16] bf16 8192 x 2; kv 1024 x 2; k_scale [1, 1024] f32 4096 x 4 (follows j); out
    # 262144 x 4.
    assert fwd.blocks["k_scale"] == (1, 1024) and fwd.fetches["k_scale"] == 4
    assert fwd.hbm_bytes == 2 * 524288 + 4 * 131072 + 2 * 8192 + 2 * 1024 + 4 * 4096 + 4 * 262144
    # VMEM: 2 * (524288 + 131072 + weights [2, 128, 16 -> 128] bf16 65536 + 65536 + k_scale [1 -> 8, 1024]
    # f32 32768 + 262144) = 2162688; 3 f32 compute-block tiles [128, 1024] 1572864 (a chunk's head sum,
    # the sum over chunks, the scores); bf16 upcasts of a chunk's stacked q [16 * 128, 128] 524288 and of
    # a compute block of k [1024, 128] 262144; a head group's float32 logits [16, 128, 1024] 8388608.
    assert fwd.vmem_bytes == 2162688 + 1572864 + 524288 + 262144 + 8388608
    # Min bytes of dq_dweights: q 32*256*128*1 = 1048576, k 262144, weights 16384, kv 2048, k_scale 2048*4,
    # g 1048576, dq in bf16 2097152, dweights 16384.
    assert dq.fetches["dq"] == 4
    assert dq.min_hbm_bytes == 1048576 + 262144 + 16384 + 2048 + 8192 + 1048576 + 2097152 + 16384
    # dk: q 8 x 262144, k 2 x 131072, weights 8 x 4096, kv_bounds 4 x 1024, the key scales k_scale
    # [1, 1024] f32 2 x 4096, g 4 x 262144; writes dk [1024, 128] bf16 262144 and dk_scale [1, 1024]
    # f32 4096, twice each.
    assert dk.fetches["dk"] == 2 and dk.fetches["dk_scale"] == 2
    assert dk.hbm_bytes == (
        8 * 262144 + 2 * 131072 + 8 * 4096 + 4 * 1024 + 2 * 4096 + 4 * 262144 + 2 * 262144 + 2 * 4096
    )
    # The MXU runs bf16 (float8 is upcast in VMEM), and the key scale makes the cotangent inexact there:
    # dq's masked cotangent goes as a head and a tail (3 passes of 2**32), then once per q block and
    # chunk the weights' one-hot broadcast, 2 * 16 FLOPs per (head, query, d) of q (2**20 of them);
    # dk's dlogits split (3 passes), 2 * 2**24 elementwise, the mask per head chunk, 2 * 6 * 2**19, and
    # once per w tile dk_scale from the summed dk and k: two dots with ones, 4 FLOPs per (block, d).
    assert fwd.mxu_itemsize == 2 and dq.mxu_flops == 3 * 2**32 + 32 * 2**20
    assert dk.flops == 3 * 2**32 + 2 * 2**24 + 12 * 2**19 + 4 * 2048 * 128


def test_float32_default_precision_is_one_bf16_pass():
    policy = DtypePolicy(qk="float32", weights="float32", out="float32", matmul_precision="default")
    f32_default = _replan(SM_F32, policy=policy)
    [fwd, dq, *_] = cost.variant_costs(f32_default, (1, 2, 32, 128, 256))
    assert fwd.mxu_itemsize == 2 and cost.variant_costs(SM_F32, (1, 2, 32, 128, 256))[0].mxu_itemsize == 4
    # float32 q/k: the gradient matmul is one dot, whatever the precision (sequence-major: no one-hot
    # broadcast of the weights at the finish).
    assert dq.mxu_flops == 2 * 4194304


@pytest.mark.parametrize(
    "name",
    [
        "tpu_hm_bf16_q256_w2048c512f256_hc16",
        "tpu_sm_f32_q16_w128_hcall",
        "tpu_sm_fp8_q256_w2048c512f256_hcall",
    ],
)
def test_generated_cost_estimates_are_the_model(name):
    """Every pallas_call carries a pl.CostEstimate equal to codegen.cost's FLOPs and HBM bytes."""
    module = VARIANTS[name]
    shape = (2, 32, 300, 128, 2100)
    q, k, weights = support.make_inputs(module.VARIANT, shape, seed=0)

    def loss(q, k, weights):
        return jnp.sum(support.call(module, q, k, weights).astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, weights)
    estimates = {
        support.kernel_name(e, name): e.params["cost_estimate"] for e in support.pallas_calls(jaxpr.jaxpr)
    }
    the_plan = family().plan(name)
    assert set(estimates) == {k.name for k in cost.call_kernels(the_plan, shape)}
    for kernel, estimate in estimates.items():
        model = cost.kernel_cost(the_plan, the_plan.kernel(kernel), shape)
        assert (estimate.flops, estimate.bytes_accessed, estimate.transcendentals) == (
            model.flops,
            model.hbm_bytes,
            0,
        ), kernel


def test_blocks_with_no_work_park_their_reads():
    """Where no query sees anything, every kernel's index maps name one block of each operand they park
    (``_operands.park``: block 0's) at every step of a batch element, so it is fetched once per batch
    element; the model counts those first fetches as none."""
    name = "tpu_hm_bf16_q256_w2048c512f256_hcall"
    module, the_plan = VARIANTS[name], family().plan(name)
    shape = (2, 32, 600, 128, 2100)  # several q blocks and w tiles
    q, k, weights = support.make_inputs(module.VARIANT, shape, seed=0)
    nothing = jnp.zeros((2, shape[2]), jnp.int32)
    loss = lambda q, k, weights: jnp.sum(
        module.score(q, k, weights, kv_start=nothing, kv_end=nothing).astype(jnp.float32)
    )
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, weights)
    x = module.prepare(q, k, weights, nothing, nothing, None)
    hidden = np.zeros((2, shape[2])), np.zeros((2, shape[2]))
    kinds = cost.block_kinds(cost.tiling(the_plan, shape), *hidden)
    assert kinds.q_blocks_with_work == kinds.w_tiles_with_work == 0 < kinds.q_blocks
    parked_seen = 0
    for eqn in support.pallas_calls(jaxpr.jaxpr):
        kernel = the_plan.kernel(support.kernel_name(eqn, name))
        model = cost.kernel_cost(the_plan, kernel, shape, hidden)
        prefetch = [getattr(x.ranges, n) for n in kernel.scalar_prefetch]
        for block, bm in zip(kernel.blocks, eqn.params["grid_mapping"].block_mappings):
            if block.name not in kernel.parked_operands():
                continue
            indices = set(_block_indices(bm, model.grid, prefetch))
            assert len({index[1:] for index in indices}) == 1, (kernel.name, block.name, sorted(indices)[:4])
            assert model.hbm_bytes_by_operand[block.name] == 0, (kernel.name, block.name)
            parked_seen += 1
    assert parked_seen >= 4  # q, weights and kv_bounds of the forward and dq; k of dk
