"""Diagrams of the book: the compression pipeline, the chapters' dependencies and reading
paths, and PolarQuant's tree. They draw structure, not data, so they are plain matplotlib
boxes and arrows; the facts they show (which chapter needs which, what each stage is) live
here as data, ``CHAPTERS``, ``DEPENDS`` and ``READING_PATHS``, which the book's tests check
against the table of contents."""
from __future__ import annotations

from .style import COLORS, figure

# chapter number -> (short title, file stem in book/)
CHAPTERS = {
    1: ("The memory wall", "ch01_memory_wall"),
    2: ("Rotations", "ch02_rotations"),
    3: ("Lloyd–Max", "ch03_lloyd_max"),
    4: ("QJL", "ch04_qjl"),
    5: ("PolarQuant", "ch05_polarquant"),
    6: ("FibQuant", "ch06_fibquant"),
    7: ("KV cache in MLX", "ch07_kv_cache"),
    8: ("Bit-Axon's window", "ch08_bitaxon"),
    9: ("Real models", "ch09_real_models"),
    10: ("Beyond the paper", "ch10_beyond_the_paper"),
    11: ("Performance", "ch11_performance"),
    12: ("Qwen2.5-Coder", "ch12_qwen_coder"),
}

# chapter -> the chapters whose results it uses (read those first)
DEPENDS = {
    1: (), 2: (1,), 3: (2,), 4: (3,), 5: (2, 3), 6: (2, 3), 7: (1, 3), 8: (7,), 9: (7, 8),
    10: (9,), 11: (1, 7, 9, 10), 12: (2, 9, 10, 11),
}

READING_PATHS = {
    "theory": (1, 2, 3, 4, 5, 6),      # chapter 1 for its primer (attention, the cache)
    "systems": (1, 7, 8, 11),
    "practitioner": (1, 3, 7, 9, 10, 12),
}

# the pipeline's stages: (name, what it does, chapters)
PIPELINE = (
    ("x", "a key or value\n(D numbers)", (1,)),
    ("norm", "ν = ‖x‖ kept in fp16,\nu = x / ν", (3,)),
    ("rotate", "y = Π u: every\ncoordinate ~ $f_D$", (2,)),
    ("codebook", "scalar · polar ·\nvector · transform", (3, 4, 5, 6, 10)),
    ("pack", "b-bit indices\ninto bytes", (3, 7)),
    ("cache", "ring · sinks ·\nexact window", (7, 8)),
    ("attend", "scores and outputs\nfrom the codes", (7, 11)),
)


def _box(ax, x, y, w, h, text, colour, fontsize=9, weight="normal"):
    from matplotlib.patches import FancyBboxPatch
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.06",
                                fc=colour, ec="0.3", lw=0.8))
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, weight=weight)


def _arrow(ax, a, b, colour="0.35"):
    ax.annotate("", xy=b, xytext=a, arrowprops=dict(arrowstyle="-|>", color=colour, lw=1.0,
                                                    shrinkA=0, shrinkB=0))


def plot_pipeline():
    """The path of one key or value through every codec in the book: ``PIPELINE``'s stages
    in reading order (two rows), each labelled with what it does and the chapters that
    derive it."""
    fig, ax = figure(width=7.6, height=3.6)
    w, step = 1.5, 1.9
    first = 4                                          # stages on the first row
    pos = [(i * step, 1.0) if i < first else ((i - first) * step + step / 2, -0.75)
           for i in range(len(PIPELINE))]
    for i, ((name, what, chapters), (x, y)) in enumerate(zip(PIPELINE, pos)):
        _box(ax, x, y + 0.42, w, 0.42, name, COLORS[i % len(COLORS)] + "40", fontsize=10, weight="bold")
        ax.text(x, y - 0.08, what, ha="center", va="center", fontsize=8.5)
        ax.text(x, y - 0.5, "Ch. " + ", ".join(map(str, chapters)), ha="center", va="center",
                fontsize=8.5, color="0.3", style="italic")
        if i == first:                                 # from the end of the first row down to the second
            (x0, y0) = pos[i - 1]
            _arrow(ax, (x0, y0 - 0.64), (x, y + 0.64))
        elif i:
            (x0, y0) = pos[i - 1]
            _arrow(ax, (x0 + w / 2, y0 + 0.42), (x - w / 2, y + 0.42))
    xs = [x for x, _ in pos]
    ax.set_xlim(min(xs) - w / 2 - 0.1, max(xs) + w / 2 + 0.1)
    ax.set_ylim(-1.4, 1.75)
    ax.axis("off")
    fig.tight_layout()
    return fig


# where each chapter sits in the map: (column, row)
_MAP_LAYOUT = {2: (-0.5, 0), 1: (1.5, 0), 3: (-0.5, 1), 4: (-2, 2), 5: (-1, 2), 6: (0, 2), 7: (1.5, 2),
               8: (0.5, 3), 9: (1.5, 3), 11: (2.5, 3), 10: (1.5, 4), 12: (1.5, 5)}


def _requires(chapter: int) -> set:
    """Every chapter ``chapter`` builds on, directly or through another."""
    out = set()
    for d in DEPENDS[chapter]:
        out |= {d} | _requires(d)
    return out


def plot_chapter_map():
    """The chapters as a graph: an arrow from A to B when B uses A's results (``DEPENDS``;
    an arrow implied by a path through other chapters is left out), each chapter coloured
    by the first reading path it belongs to, with a dot for each further path."""
    pos = {c: (x * 2.5, -row * 1.15) for c, (x, row) in _MAP_LAYOUT.items()}
    path_colour = {p: COLORS[i] for i, p in enumerate(READING_PATHS)}
    rows = 1 + max(row for _, row in _MAP_LAYOUT.values())
    fig, ax = figure(width=8.0, height=1.2 + 0.95 * rows)
    for c, deps in DEPENDS.items():
        for d in deps:
            if any(d in _requires(e) for e in deps if e != d):
                continue                          # drawn through e already
            (x0, y0), (x1, y1) = pos[d], pos[c]
            _arrow(ax, (x0, y0 - 0.27), (x1, y1 + 0.27))
    for c, (x, y) in pos.items():
        paths = [p for p, cs in READING_PATHS.items() if c in cs]
        colour = path_colour[paths[0]] + "55" if paths else "0.92"
        _box(ax, x, y, 2.2, 0.52, f"{c}. {CHAPTERS[c][0]}", colour, fontsize=8.5)
        for k, p in enumerate(paths[1:]):
            ax.plot(x + 0.95 - 0.18 * k, y + 0.16, "o", ms=6, color=path_colour[p])
    for i, p in enumerate(READING_PATHS):
        ax.plot([], [], "s", ms=9, color=path_colour[p], alpha=0.7,
                label=f"{p}: " + ", ".join(map(str, READING_PATHS[p])))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, frameon=False, fontsize=8.5,
              title="reading paths (a dot: also on that path)", title_fontsize=8.5)
    xs = [x for x, _ in pos.values()]
    ys = [y for _, y in pos.values()]
    ax.set_xlim(min(xs) - 1.3, max(xs) + 1.3)
    ax.set_ylim(min(ys) - 0.45, max(ys) + 0.45)
    ax.axis("off")
    fig.tight_layout()
    return fig


def plot_polar_tree(dim: int = 8):
    """PolarQuant's recursive polar transform as a tree for a ``dim``-coordinate vector
    (4, 8 or 16): level 1 pairs coordinates into angles ψ¹ and radii r¹, each later level
    pairs the radii below it; the top level's radius is the vector's norm."""
    if dim not in (4, 8, 16):
        raise ValueError(f"plot_polar_tree draws dim = 4, 8 or 16, got {dim!r}")
    levels = dim.bit_length() - 1
    fig, ax = figure(width=1.0 + 0.62 * dim, height=1.0 + 0.95 * levels)
    xs = [float(i) for i in range(dim)]
    for i, x in enumerate(xs):
        ax.text(x, 0, f"$y_{{{i + 1}}}$", ha="center", va="center", fontsize=10)
    for level in range(1, levels + 1):
        parents = [(xs[2 * j] + xs[2 * j + 1]) / 2 for j in range(len(xs) // 2)]
        y0, y1 = -(level - 1) * 1.0 - (0.15 if level == 1 else 0.25), -level * 1.0 + 0.25
        for j, x in enumerate(parents):
            for child in (xs[2 * j], xs[2 * j + 1]):
                ax.plot([child, x], [y0, y1], c="0.55", lw=0.9)
            _box(ax, x, -level * 1.0, 1.6, 0.42, f"$\\psi^{{{level}}}_{{{j + 1}}},\\ r^{{{level}}}_{{{j + 1}}}$",
                 COLORS[level % len(COLORS)] + "40", fontsize=9)
        ax.text(-0.9, -level * 1.0, f"level {level}", ha="right", va="center", fontsize=8.5, color="0.3")
        xs = parents
    ax.text((dim - 1) / 2, -levels * 1.0 - 0.45, "stored: every angle ψ, quantized with its level's codebook, and "
            "the top radius in fp16;\nthe radii below the top are recomputed from them on decoding",
            ha="center", va="top", fontsize=8.5, color="0.3")
    ax.set_xlim(-2.2, dim - 0.4)
    ax.set_ylim(-levels * 1.0 - 1.05, 0.45)
    ax.axis("off")
    fig.tight_layout()
    return fig


def plot_nibble_lookup(indices=(10, 3, 1, 15, 7, 0, 4, 12)):
    """How the CPU kernel turns 4-bit codes into floats (Chapter 11), for 8 coordinates:
    packed bytes (index 2j in the low nibble of byte j, 2j + 1 in the high one) → the two
    nibbles split and interleaved back into coordinate order → one permute that reads each
    lane's centroid from the 16-entry codebook held in a register → floats, multiplied into
    the rotated query (scores) or accumulated with the token's weight (values)."""
    idx = [int(i) for i in indices]
    if len(idx) % 2 or not all(0 <= i < 16 for i in idx):
        raise ValueError(f"plot_nibble_lookup needs an even number of 4-bit indices, got {indices!r}")
    n = len(idx)
    packed = [idx[2 * j] | (idx[2 * j + 1] << 4) for j in range(n // 2)]
    fig, ax = figure(width=10.0, height=4.6)
    rows = {"bytes": 3.2, "indices": 2.2, "codebook": 1.1, "floats": 0.0}
    for j, byte in enumerate(packed):                     # a byte spans two coordinate columns
        _box(ax, 2 * j + 0.5, rows["bytes"], 1.8, 0.45, f"0x{byte:02X}", COLORS[0] + "30", fontsize=10)
    for i, v in enumerate(idx):
        _box(ax, i, rows["indices"], 0.8, 0.45, str(v), (COLORS[1] if i % 2 else COLORS[2]) + "30", fontsize=10)
        ax.plot([i, i], [rows["bytes"] - 0.24, rows["indices"] + 0.24], c="0.6", lw=0.8)
    cb_x = [n + 1.2 + 0.38 * c for c in range(16)]            # the register: 16 centroids
    for c, x in enumerate(cb_x):
        _box(ax, x, rows["codebook"], 0.34, 0.45, f"$c_{{{c}}}$", COLORS[3] + "25", fontsize=7)
    for i, v in enumerate(idx):
        _box(ax, i, rows["floats"], 0.8, 0.45, f"$c_{{{v}}}$", COLORS[4] + "30", fontsize=9)
        ax.annotate("", xy=(i, rows["floats"] + 0.24), xytext=(cb_x[v], rows["codebook"] - 0.24),
                    arrowprops=dict(arrowstyle="-|>", color="0.5", lw=0.6, alpha=0.8))
    label = dict(ha="left", va="center", fontsize=9, color="0.25")
    ax.text(n + 0.2, rows["bytes"], "packed bytes of one token: index 2j in the low nibble, 2j + 1 in the high", **label)
    ax.text(n + 0.2, rows["indices"], "split (& 0x0F, >> 4) and interleaved: indices in coordinate order", **label)
    ax.text(cb_x[0] - 0.2, rows["codebook"] + 0.45, "the 16 centroids, one AVX-512 register", **label)
    ax.text(n + 0.2, rows["floats"], "one permute: lane i takes centroid $c_{\\mathrm{idx}_i}$;\n"
            "then × the rotated query (scores) or + $p_t\\nu_t$ × it (values)", **label)
    ax.set_xlim(-0.6, cb_x[-1] + 0.4)
    ax.set_ylim(-0.5, 3.7)
    ax.axis("off")
    fig.tight_layout()
    return fig
