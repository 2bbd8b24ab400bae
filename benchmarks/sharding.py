"""What each sharded_score mode communicates: the collectives of the compiled forward and backward
programs on a simulated 8-device mesh, at the production shape, with their bytes per device.

The programs are lowered and compiled, never run. There is no TPU here, so they are compiled for
the CPU with the kernels interpreted; the collectives around the kernels (the only communication)
are the ones the TPU program has. Inputs arrive laid out as ``sharded_score`` shards them (as in a
model whose activations are sharded so), so no resharding is counted.

    python benchmarks/sharding.py [--variant NAME] [--shape B,H,S,D,W] [--mode MODE ...]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join(
    [
        *os.environ.get("XLA_FLAGS", "").split(),
        "--xla_force_host_platform_device_count=8",
        "--xla_backend_optimization_level=0",
    ]
)

import argparse  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from generated.csa_v4 import VARIANTS  # noqa: E402

DEFAULT_VARIANT = "tpu_sm_bf16_q256_w2048c512f256_hc16"
# mode: (mesh shape, axis names, sharded_score arguments)
MODES = {
    "data": ((8,), ("data",), {}),
    "context": ((8,), ("context",), dict(context_axis="context")),
    "data x context": ((2, 4), ("data", "context"), dict(context_axis="context")),
    "data x heads": ((2, 4), ("data", "heads"), dict(head_axis="heads")),
    "data x context x heads": (
        (2, 2, 2),
        ("data", "context", "heads"),
        dict(context_axis="context", head_axis="heads"),
    ),
}
COLLECTIVE = re.compile(
    r"=\s*(\([^)]*\)|\S+)\s+(all-gather|all-to-all|all-reduce|reduce-scatter|collective-permute)(?:-start)?\("
)
ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
HLO_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
}
# replica_groups as JAX 0.10 prints them ({{0,1,2,3},...}), as 0.12 does (mesh['data'=2,'context'=4]
# {'context'}), and in XLA's iota form ([2,4]<=[8]).
GROUPS_LISTED = re.compile(r"replica_groups=\{\{([\d,]*)\}")
GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
GROUPS_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]<=")


def group_size(line: str) -> int:
    """Devices per replica group of a collective's HLO line (0 when it names none)."""
    if match := GROUPS_LISTED.search(line):
        return len(match.group(1).split(","))
    if match := GROUPS_MESH.search(line):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", match.group(1)))
        return int(np.prod([int(sizes[axis]) for axis in re.findall(r"'([^']+)'", match.group(2))]))
    if match := GROUPS_IOTA.search(line):
        return int(match.group(1))
    return 0


def collectives(hlo_text: str) -> list[tuple[str, str, int, int]]:
    """(kind, result type, bytes per device, devices per group) of every collective in a compiled program."""
    found = []
    for line in hlo_text.splitlines():
        match = COLLECTIVE.search(line)
        if not match:
            continue
        result, kind = match.groups()
        arrays = ARRAY.findall(result)
        size = sum(
            int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * HLO_BYTES[dtype]
            for dtype, dims in arrays
        )
        group = group_size(line)
        types = ", ".join(f"{dtype}[{dims}]" for dtype, dims in arrays)
        found.append((kind, types, size, group))
    return found


def describe(kind, types, size, group):
    text = f"{kind} {types} in groups of {group}: {size / 2**20:,.1f} MiB"
    if kind == "all-reduce" and group:
        text += f", sends {2 * (group - 1) / group * size / 2**20:,.1f} MiB"
    return text


def programs(module, shape, mesh_shape, names, kwargs):
    """Compiled text of the forward and of the backward (the VJP at a given cotangent) of one mode."""
    batch, heads, seq_len, head_dim, num_blocks = shape
    mesh = jax.make_mesh(mesh_shape, names)
    variant = module.VARIANT
    seq_major = variant["q_layout"] == "seq_major"
    q_shape = (batch, seq_len, heads, head_dim) if seq_major else (batch, heads, seq_len, head_dim)
    b = "data" if "data" in names else None
    s, h = kwargs.get("context_axis"), kwargs.get("head_axis")
    arrays = dict(
        q=(jax.ShapeDtypeStruct(q_shape, variant["q_dtype"]), P(b, s, h) if seq_major else P(b, h, s)),
        k=(jax.ShapeDtypeStruct((batch, num_blocks, head_dim), variant["k_dtype"]), P(b)),
        weights=(jax.ShapeDtypeStruct((batch, seq_len, heads), variant["weights_dtype"]), P(b, s, h)),
        kv_start=(jax.ShapeDtypeStruct((batch, seq_len), jnp.int32), P(b, s)),
        kv_end=(jax.ShapeDtypeStruct((batch, seq_len), jnp.int32), P(b, s)),
    )
    if variant["k_scale"]:
        arrays["k_scale"] = (jax.ShapeDtypeStruct((batch, num_blocks), jnp.float32), P(b))
    args = {
        name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
        for name, (x, spec) in arrays.items()
    }
    cotangent = jax.ShapeDtypeStruct(
        (batch, seq_len, num_blocks), variant["out_dtype"], sharding=NamedSharding(mesh, P(b, s))
    )
    differentiable = [name for name in args if not name.startswith("kv_")]

    def forward(args):
        return module.sharded_score(**args, mesh=mesh, interpret=True, **kwargs)

    def backward(args, cotangent):
        fixed = {name: x for name, x in args.items() if name not in differentiable}
        fn = lambda diff: forward({**diff, **fixed})
        return jax.vjp(fn, {name: args[name] for name in differentiable})[1](cotangent)

    return {
        "forward": jax.jit(forward).lower(args).compile().as_text(),
        "backward": jax.jit(backward).lower(args, cotangent).compile().as_text(),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default=DEFAULT_VARIANT)
    parser.add_argument("--shape", default="8,64,8192,128,2048", help="B,H,S,D,W")
    parser.add_argument("--mode", action="append", choices=sorted(MODES))
    args = parser.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    module = VARIANTS[args.variant]
    print(f"sharded_score({args.variant}) at B,H,S,D,W = {','.join(map(str, shape))} on 8 simulated devices")
    print("collectives of the compiled programs, with each device's buffer and what a ring all-reduce")
    print("sends from each device (2 (n - 1) / n of the buffer, n devices per group)")
    print(f"{'mode':24s} {'mesh':30s} {'program':9s} collectives")
    for mode in args.mode or list(MODES):
        mesh_shape, names, kwargs = MODES[mode]
        mesh_text = " x ".join(f"{n}={d}" for n, d in zip(names, mesh_shape))
        for program, text in programs(module, shape, mesh_shape, names, kwargs).items():
            found = collectives(text)
            lines = [describe(*collective) for collective in found]
            print(f"{mode:24s} {mesh_text:30s} {program:9s} {lines[0] if lines else 'none'}")
            for line in lines[1:]:
                print(f"{'':24s} {'':30s} {'':9s} {line}")
            mode, mesh_text = "", ""


if __name__ == "__main__":
    main()
