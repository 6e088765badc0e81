"""Bytes per token that one mHC unit (mhc_post_pre, forward and backward) must move, and what the five Triton
kernels move: the floor and the design bound that `python -m scripts.bench_kernels mhc` prints beside its timings,
and the stream bytes on which its block sweep rates each kernel (`python -m scripts.mhc_bytes` prints the step
arithmetic)."""
from __future__ import annotations

from kernels import mhc_reference as R


def floor_bytes_per_token(n: int, C: int, stream_bytes: int = 2) -> dict[str, int]:
    """Bytes per token one mhc_post_pre must move: each input read once, each output written once.

    forward:  reads x (n*C) and y (C), writes x' (n*C) and u (C)            -> (2n+2)*C stream elements
              + fp32 coefficients: reads H_res, H_post; writes H_res', H_post', raw (n^2+2n), inv_rms
    backward: reads dx' (n*C), du (C), x (n*C), y (C); writes dx (n*C), dy (C) -> (3n+3)*C elements
              + fp32: reads dH_res', dH_post', H_res, H_post, raw, inv_rms; writes dH_res, dH_post
    (x' is recomputed from x and y in the backward rather than read.)
    """
    coef = 4 * (n * n + n)
    saved = 4 * (R.mhc_num_coefficients(n) + 1)
    fwd = stream_bytes * (2 * n + 2) * C + 2 * coef + saved
    bwd = stream_bytes * (3 * n + 3) * C + 3 * coef + saved
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}


def stream_rows(n: int) -> dict[str, int]:
    """Stream-width rows (C elements each) that each kernel reads or writes per token: the inputs once, the
    outputs once. kernel_bytes_per_token adds the coefficients; the block sweep rates a kernel on these alone.
    coef_premix_pre is coef_premix without the apply (mhc_pre: x in, u out)."""
    return {"coef_premix": 2 * n + 2,   # x, y in; x', u out
            "coef_premix_pre": n + 1,   # x in; u out
            "premix_grad": n + 1,       # x', du in
            "stream_bwd": 3 * n + 3,    # x, y, dx', du in; dx, dy out
            "dphi": n}                  # x' in


def kernel_bytes_per_token(n: int, C: int, stream_bytes: int = 2) -> dict[str, int]:
    """Bytes per token that each of the unit's five kernels moves, reading every input once and writing every
    output once: what the kernels of this design could reach at copy bandwidth, against the floor above.

    The floor recomputes x' in the backward and gives dH_pre and d(phi) for free. Here premix_grad and dphi
    each read x' once more. d(phi)'s pre-gate columns need dH_pre (a sum over all of a token's channels), and
    folding d(phi) into the token-major stream_bwd would need an [n*C, N] accumulator per program.
    Not counted: dphi's per-program partial sums (their count depends on the GPU), and what is meant to hit
    L2: coef_premix's rereads of x' and every program's reads of phi."""
    from kernels._triton_util import num_coefficients, padded_columns
    rows = {name: count * stream_bytes * C for name, count in stream_rows(n).items()}
    mixing = 4 * (n * n + n)                      # H_res and H_post, fp32
    saved = 4 * (num_coefficients(n) + 1)         # raw projections and inv_rms, fp32
    aux = 4 * padded_columns(n)                   # G, the rms factor and H_pre, fp32
    return {
        "coef_premix": rows["coef_premix"] + 2 * mixing + saved,  # + H in and out; raw, rinv out
        "premix_grad": rows["premix_grad"] + 4 * n,               # + dH_pre out
        "coef_bwd": 4 * n + mixing + saved + aux,                 # dH_pre, dH_post, dH_res, raw, rinv in; aux out
        "stream_bwd": rows["stream_bwd"] + aux + 2 * mixing,      # + aux, H in; dH out
        "dphi": rows["dphi"] + aux,                               # + aux in
    }


def design_bound(n: int, C: int) -> str:
    """The line bench_kernels prints under the floor: the kernels' own bytes, and the share of the floor that
    they allow at copy bandwidth."""
    own = kernel_bytes_per_token(n, C)
    total, floor = sum(own.values()), floor_bytes_per_token(n, C)["fwd+bwd"]
    return (f"the kernels' own bytes/token: {', '.join(f'{k} {v}' for k, v in own.items())}; sum {total} = "
            f"{total / floor:.2f}x the floor, so at copy bandwidth this design reaches {100 * floor / total:.1f}% "
            "of the floor at most")


def step_table(ns: list[int], C: int, tokens: int, sublayers: int, gbps: float, rest_ms: list[float] | None = None,
               plain_ms: float | None = None) -> str:
    """Milliseconds that the bytes above allow at `gbps` (a measured copy bandwidth, read + write), per unit and
    per training step of `sublayers` mHC units. With rest_ms (for each n, the step's time outside its mHC kernels,
    from a profile) and plain_ms (the n=1 step), the step at the floor and its cost against the plain one."""
    head = ["n", "floor B/token", "kernels' B/token", "floor ms/unit", "design ms/unit", "floor ms/step",
            "design ms/step"]
    if rest_ms is not None:
        head += ["step at the floor, ms"] + (["vs plain"] if plain_ms else [])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, n in enumerate(ns):
        floor = floor_bytes_per_token(n, C)["fwd+bwd"]
        own = sum(kernel_bytes_per_token(n, C).values())
        floor_ms, own_ms = (b * tokens / (gbps * 1e9) * 1e3 for b in (floor, own))
        row = [str(n), f"{floor:,}", f"{own:,}", f"{floor_ms:.3f}", f"{own_ms:.3f}", f"{sublayers * floor_ms:.1f}",
               f"{sublayers * own_ms:.1f}"]
        if rest_ms is not None:
            step = rest_ms[i] + sublayers * floor_ms
            row += [f"{step:.1f}"] + ([f"{step / plain_ms:.2f}x"] if plain_ms else [])
        out.append("| " + " | ".join(row) + " |")
    return "\n".join(out)
