"""The tables of benchmarks/peers.py: a row per contender and block (a variant at one dead fraction), and the last
table, the fastest peer per block against ours.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.peer_adapters import AUXK_VARIANTS, Contender


def mebibytes(value: float) -> str:
    return f"{value:.{0 if value >= 10 else 2}f} MiB"


def dead_fraction(contender: Contender) -> float | None:
    """The fraction of latents the contender's own bookkeeping counts dead now; None: its step has no AuxK."""
    dead = contender.dead_mask()
    return None if dead is None else float(dead.float().mean())


def dead_cell(variant: str, before: float | None, after: float | None) -> str:
    if variant not in AUXK_VARIANTS:
        return "—"
    if before is None or after is None:
        return "no AuxK"
    if abs(before - after) > 1e-9:
        return f"{100 * before:.1f} → {100 * after:.1f} %"
    return f"{100 * after:.1f} %"


@dataclass
class Row:
    """One contender's figures in one block (a variant at one dead fraction)."""

    d_sae: int
    variant: str
    regime: str  # the block's dead latents: "none" or the fraction ("6.2 %")
    library: str
    name: str
    step: float
    peak: float  # MiB
    equal: str


def fastest_peers(rows: list[Row]) -> list[str]:
    """Per block, the fastest peer's step and peak memory over ours (> 1: ours is faster, or leaner)."""
    lines = [
        "| d_sae | variant | dead | ours | fastest peer | ÷ ours | peak memory ÷ ours |",
        "|---|---|---|---|---|---|---|",
    ]
    blocks: dict[tuple[int, str, str], list[Row]] = {}
    for row in rows:
        blocks.setdefault((row.d_sae, row.variant, row.regime), []).append(row)
    for (d_sae, variant, regime), block in blocks.items():
        ours = next(row for row in block if row.library == "ours")
        peers = [row for row in block if row.library != "ours"]
        if not peers:
            lines.append(f"| {d_sae} | {variant} | {regime} | {ours.step:.3g} s | no peer | — | — |")
            continue
        best = min(peers, key=lambda row: row.step)
        lines.append(
            f"| {d_sae} | {variant} | {regime} | {ours.step:.3g} s | {best.library} {best.step:.3g} s | "
            f"{best.step / ours.step:.3g} | {best.peak / ours.peak:.3g} |"
        )
    return lines


CONTENDER_HEADER = (
    "| d_in | d_sae | contender | step | ÷ ours | ÷ GEMM | peak memory | resident | equal to ours | dead |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def contender_line(d_in: int, row: Row, ours_step: float, gemm: float, resident: float, dead: str) -> str:
    """One contender's row in one block (times in seconds, memory in MiB)."""
    return (
        f"| {d_in} | {row.d_sae} | {row.name} | {row.step:.3g} s | {row.step / ours_step:.3g} | "
        f"{row.step / gemm:.3g} | {mebibytes(row.peak)} | {mebibytes(resident)} | {row.equal} | {dead} |"
    )
