"""How the cost of private training grows with batch size and sequence length.

For the benchmark transformer (benchmarks/models.py) it runs benchmarks/speed.py
once per point, in a fresh process, and collects its side-by-side ratio: the
default private step (train_on_batch) over the best non-private configuration
of the same shape. Two sweeps: batch size at --sequence_length tokens, and
sequence length at --sequence_batch_size examples. It prints a Markdown table
and writes the same numbers as an SVG plot (no plotting library needed).

Usage:
  python benchmarks/scaling.py --svg=docs/transformer_scaling.svg
  python benchmarks/scaling.py --batch_sizes=64,256 --sequence_lengths=64,128
"""

import os
import re
import subprocess
import sys

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_list("batch_sizes", "64,128,256,512,1024,2048,4096",
                  "Batch sizes of the first sweep.")
flags.DEFINE_integer("sequence_length", 64, "Tokens per example in the batch sweep.")
flags.DEFINE_list("sequence_lengths", "64,128,256,512", "Lengths of the second sweep.")
flags.DEFINE_integer("sequence_batch_size", 64, "Examples per step in the length sweep.")
flags.DEFINE_integer("tokens_per_round", 2**17,
                     "Tokens timed per round and configuration (at least 2 steps).")
flags.DEFINE_integer("repeats", 3, "Rounds; each configuration keeps its best.")
flags.DEFINE_string("svg", None, "Where to write the plot (optional).")

SPEED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "speed.py")
RATIO = re.compile(r"^default private .* step speed ([0-9.]+)", re.MULTILINE)


def private_ratio(batch_size, sequence_length):
    """speed.py's step-speed ratio, private over best non-private, or None."""
    steps = max(2, FLAGS.tokens_per_round // (batch_size * sequence_length))
    done = subprocess.run(
        [sys.executable, SPEED, "--models=transformer", "--modes=step", "--memory=false",
         "--configs=keras,keras_xla,private", f"--batch_size={batch_size}",
         f"--sequence_length={sequence_length}", f"--steps={steps}", "--warmup_steps=2",
         f"--repeats={FLAGS.repeats}"],
        capture_output=True, text=True)
    found = RATIO.search(done.stdout)
    if not found:
        print(f"batch {batch_size}, length {sequence_length}: no ratio "
              f"({(done.stderr.strip().splitlines() or ['no output'])[-1][:200]})",
              file=sys.stderr)
        return None
    return float(found.group(1))


def svg_plot(sweeps):
    """A two-panel line plot of `sweeps`: [(title, x label, [(x, ratio)])]."""
    width, height, margin = 320, 220, 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * len(sweeps)}" '
             f'height="{height}" font-family="sans-serif" font-size="11">']
    for panel, (title, label, points) in enumerate(sweeps):
        left = panel * width + margin
        plot_w, plot_h = width - 1.5 * margin, height - 2 * margin
        xs = range(len(points))  # Sizes double: evenly spaced on a log axis.
        to_x = lambda i: left + plot_w * i / max(1, len(points) - 1)  # noqa: E731
        to_y = lambda r: margin + plot_h * (1 - min(r, 1.2) / 1.2)  # noqa: E731
        parts.append(f'<text x="{left}" y="{margin - 22}">{title}</text>')
        parts.append(f'<text x="{left + plot_w / 2}" y="{height - 6}" '
                     f'text-anchor="middle">{label}</text>')
        for tick in (0.0, 0.4, 0.8, 1.2):
            y = to_y(tick)
            parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y}" y2="{y}" '
                         f'stroke="{"#c33" if tick == 0.8 else "#ddd"}"/>')
            parts.append(f'<text x="{left - 6}" y="{y + 4}" text-anchor="end">{tick:.1f}</text>')
        measured = [(to_x(i), to_y(r)) for i, (_, r) in zip(xs, points) if r is not None]
        parts.append('<polyline fill="none" stroke="#36c" stroke-width="2" points="'
                     + " ".join(f"{x:.1f},{y:.1f}" for x, y in measured) + '"/>')
        for i, (size, ratio) in zip(xs, points):
            parts.append(f'<text x="{to_x(i)}" y="{margin + plot_h + 14}" '
                         f'text-anchor="middle">{size}</text>')
            if ratio is not None:
                parts.append(f'<circle cx="{to_x(i):.1f}" cy="{to_y(ratio):.1f}" r="3" '
                             f'fill="#36c"/>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv):
    del argv
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset")
    batch_points = [(int(b), private_ratio(int(b), FLAGS.sequence_length))
                    for b in FLAGS.batch_sizes]
    length_points = [(int(t), private_ratio(FLAGS.sequence_batch_size, int(t)))
                     for t in FLAGS.sequence_lengths]
    show = lambda r: "failed" if r is None else f"{r:.2f}"  # noqa: E731
    print(f"private / best non-private step speed, transformer, "
          f"TF_ENABLE_ONEDNN_OPTS={onednn}")
    print(f"\n| batch size ({FLAGS.sequence_length} tokens) | ratio |\n| --- | --- |")
    for size, ratio in batch_points:
        print(f"| {size} | {show(ratio)} |")
    print(f"\n| sequence length (batch {FLAGS.sequence_batch_size}) | ratio |\n| --- | --- |")
    for length, ratio in length_points:
        print(f"| {length} | {show(ratio)} |")
    if FLAGS.svg:
        with open(FLAGS.svg, "w") as svg:
            svg.write(svg_plot([
                (f"by batch size ({FLAGS.sequence_length} tokens)", "batch size", batch_points),
                (f"by sequence length (batch {FLAGS.sequence_batch_size})", "tokens",
                 length_points)]))


if __name__ == "__main__":
    app.run(main)
