"""Private vs. non-private training speed and memory, side by side in one run.

For each model (benchmarks/models.py: the Fashion-MNIST CNN, a 784-512-512-10
MLP, a 2-block transformer; and, when asked, gpt2_lora: LoRA fine-tuning of a
GPT-2-shaped Keras Hub backbone) it measures training examples/second at
--batch_size in several ways (--modes): `step`, train_on_batch on one fixed
random batch after warm-up steps; `fit`, fit() on --fit_examples random
in-memory examples, as users train (private models draw Poisson batches,
padded and of varying size; non-private ones shuffle), counting the expected
batch of each step after the first --warmup_steps of an epoch; and the same
epoch `fit_dataset` on a keras_dp.data.poisson_dataset (non-private: the
arrays), `fit_spe` compiled with --steps_per_execution, `fit_budget` with a
PrivacyCallback(target_epsilon=100) (non-private: none). The table shows
step and fit; a line per fit() mode gives its private / non-private
ratio and its ratio to the private step, each also by the process's CPU
time per step (which other processes' load moves far less than wall
time); a line per fit() mode the same CPU ratios within each round, their
median and range (a ratio of two bests can pair rounds minutes apart, and
this machine's speed drifts); and a last line the bound of
docs/performance.md on this machine's cores (the non-private step's CPU time
plus the noise's, both measured in the run). It measures memory at
--memory_batch_size. The configurations:

  keras, keras_xla            non-private Keras (SGD), jit_compile False / True
  private, private_xla        the default private configuration: make_private +
                              DPKerasSGD (noise 1.1, clip 1.0), clipping_engine
                              "auto"; jit_compile False / True
  vectorized, vectorized_xla  the same with clipping_engine="vectorized"
  ghost_2bw                   ghost clipping with a second backward pass
                              instead of book-keeping
  ghost_inner_xla             only the ghost clipped sum compiled with XLA

Each ratio is to the best non-private configuration of the same model.

Speed: per model one process builds every configuration and times them in
interleaved rounds (each round times every mode of every configuration in
turn), keeping each one's best round, so that load from other processes
affects all alike, and each round's CPU time for the ratios within a
round. Memory: each configuration runs alone in a fresh process, which
reports its peak resident set and that peak's growth over the process
with TensorFlow, Keras and keras_dp loaded (the training's own memory, tracing and kernel caches
included); and, in another fresh process whose TensorFlow counts its CPU
allocations (TF_CPU_ALLOCATOR_USE_BFC), the peak of the tensors alive during
two traced steps (weights, activations, gradients, per-example terms).

Usage:
  python benchmarks/speed.py                          # all models, default configurations
  python benchmarks/speed.py --onednn=0,1 --configs=keras,private --nomemory
  python benchmarks/speed.py --models=mlp --configs=keras,private,vectorized --steps=20
  python benchmarks/speed.py --models=gpt2_lora --configs=keras,private \
      --batch_size=32 --memory_batch_size=64 --steps=5 --repeats=3
"""

import json
import math
import os
import platform
import resource
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Children import keras_dp and benchmarks.models from this checkout.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from benchmarks.timing import round_ratios  # noqa: E402
from benchmarks.timing import timed_fit  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("models", "cnn,mlp,transformer",
                  "Models: cnn, mlp, transformer, gpt2_lora.")
flags.DEFINE_list("configs", "keras,keras_xla,private,private_xla",
                  "Configurations (see the module docstring).")
flags.DEFINE_list("modes", "step,fit,fit_dataset,fit_spe,fit_budget",
                  "How speed is measured (see the module docstring): step, fit, "
                  "fit_dataset, fit_spe, fit_budget.")
flags.DEFINE_integer("steps_per_execution", 8, "compile(steps_per_execution=) of fit_spe.")
flags.DEFINE_integer("batch_size", 256, "Examples per step when timing.")
flags.DEFINE_integer("fit_examples", 10240, "In-memory examples of one fit() epoch.")
flags.DEFINE_integer("sequence_length", 64, "Tokens per example of the transformer.")
flags.DEFINE_integer("memory_batch_size", 1024, "Examples per step when measuring memory.")
flags.DEFINE_integer("steps", 30, "Timed training steps per round.")
flags.DEFINE_integer("warmup_steps", 3, "Untimed steps first (tracing, compilation).")
flags.DEFINE_integer("repeats", 5, "Interleaved timed rounds; each configuration keeps its best.")
flags.DEFINE_list("onednn", [], "TF_ENABLE_ONEDNN_OPTS of the runs, e.g. 0,1 for both "
                  "in turn; empty: this process's setting.")
flags.DEFINE_bool("memory", True, "Also measure peak memory (one process per configuration).")
flags.DEFINE_string("child", None,
                    "Internal: 'speed|memory|tensors:model:configs' for this process.")

CONFIGS = {
    "keras": "non-private Keras, jit_compile=False",
    "keras_xla": "non-private Keras, jit_compile=True",
    "private": "keras-dp private, jit_compile=False",
    "private_xla": "keras-dp private, jit_compile=True",
    "vectorized": "vectorized engine, jit_compile=False",
    "vectorized_xla": "vectorized engine, jit_compile=True",
    "ghost_2bw": "ghost, 2nd backward pass",
    "ghost_inner_xla": "ghost, XLA around the clipped sum",
}
MODES = ["step", "fit", "fit_dataset", "fit_spe", "fit_budget"]
# The modes of the table's columns; the other fit() modes get a line each.
TABLE_MODES = ("step", "fit")
FIT_VARIANTS = {
    "fit": "fit() on arrays",
    "fit_dataset": "fit() on a keras_dp.data.poisson_dataset",
    "fit_spe": "fit() with steps_per_execution={spe}",
    "fit_budget": "fit() with PrivacyCallback(target_epsilon=100)",
}
NON_PRIVATE = ("keras", "keras_xla")
# Memory columns: key -> (title, width).
MEMORY_COLUMNS = {"peak": ("peak MB", 8), "growth": ("growth MB", 10),
                  "tensors": ("tensors MB", 10)}
DEFAULT_PRIVATE = ("private", "private_xla")  # In order of preference.


# ------------------------------------------------- in the child processes


def build(model_name, config, batch_size, steps_per_execution=1):
    """Returns `(compiled model, x, y)` of one configuration."""
    import keras
    import keras_dp
    from benchmarks import models

    keras.utils.set_random_seed(0)
    model = models.MODELS[model_name](**_shape_kwargs(model_name))
    if config in NON_PRIVATE:
        optimizer = keras.optimizers.SGD(learning_rate=0.01)
    else:
        if config.startswith("ghost"):
            model = _ghost_variant(model, config)
        else:
            engine = "vectorized" if config.startswith("vectorized") else "auto"
            model = keras_dp.make_private(model, clipping_engine=engine)
        optimizer = keras_dp.DPKerasSGD(l2_norm_clip=1.0, noise_multiplier=1.1,
                                        learning_rate=0.01, seed=0)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=config.endswith("_xla") and config != "ghost_inner_xla",
                  steps_per_execution=steps_per_execution)
    x, y = models.random_batch(model_name, batch_size, **_shape_kwargs(model_name))
    return model, x, y


def _ghost_variant(model, config):
    """The private model running ghost clipping with a non-default option.
    For measurement only: its engine call is replaced on the instance (no
    private model class may replace it)."""
    import keras_dp
    from keras_dp.clipping import ghost

    private = keras_dp.make_private(model, clipping_engine="ghost")

    def clipped_gradient_sum(batch, num_microbatches, variables, bound, rows_per_unit=1):
        return ghost.clipped_gradient_sum(
            private, batch, variables, bound, ghost.per_example_loss_fn(private),
            bookkeeping=config != "ghost_2bw", jit_compile=config == "ghost_inner_xla")

    private._clipped_gradient_sum = clipped_gradient_sum
    return private


def _shape_kwargs(model_name):
    return {"sequence_length": FLAGS.sequence_length} if model_name == "transformer" else {}


def timed_steps(model, x, y):
    """`(examples/second, CPU ms per step)` of --steps train_on_batch calls
    on one batch (CPU time of the whole process, every thread)."""
    import tensorflow as tf
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(FLAGS.steps):
        logs = model.train_on_batch(x, y, return_dict=True)
    float(logs["loss"])  # Reading a value waits for the last step.
    cpu_ms = 1000 * (time.process_time() - cpu) / FLAGS.steps
    return FLAGS.steps * int(tf.nest.flatten(x)[0].shape[0]) / (time.perf_counter() - start), cpu_ms


def time_configs(model_name, configs):
    """Best-round examples/second of each configuration in each of --modes,
    in this process: `{mode: {config: examples/s}}`, and the least CPU ms
    per step of each: `{mode: {config: ms}}` (per step of the expected
    batch in the fit() modes).
    Every round times every mode of every configuration in turn, so that
    ratios between modes are side by side too; the third result keeps
    each round's CPU ms, `{mode: {config: [ms, ...]}}`, for ratios within
    a round (`round_ratios`)."""
    import keras_dp
    from benchmarks import models

    fit_data = models.random_batch(model_name, FLAGS.fit_examples,
                                   **_shape_kwargs(model_name))
    private = lambda config: config not in NON_PRIVATE  # noqa: E731

    def fit_dataset(config):
        if not private(config):  # Keras' own shuffled batches.
            return {"data": fit_data}
        return {"data": keras_dp.data.poisson_dataset(
            *fit_data, expected_batch_size=FLAGS.batch_size)}

    def fit_budget(config):
        if not private(config):
            return {"data": fit_data}
        return {"data": fit_data, "callbacks": [
            keras_dp.PrivacyCallback(delta=1e-5, target_epsilon=100.0)]}

    fit_modes = {"fit": lambda config: {"data": fit_data}, "fit_dataset": fit_dataset,
                 "fit_budget": fit_budget}
    built = {}
    for config in configs:
        try:
            built[config] = {}
            for spe in sorted({1, FLAGS.steps_per_execution if "fit_spe" in FLAGS.modes
                               else 1}):
                model, x, y = build(model_name, config, FLAGS.batch_size, spe)
                for _ in range(FLAGS.warmup_steps):
                    model.train_on_batch(x, y)
                built[config][spe] = (model, x, y)
        except Exception as error:  # Report it and go on with the others.
            built.pop(config)
            first_line = (str(error).strip().splitlines() or [""])[0]
            print(f"[{model_name} {config}] failed: {type(error).__name__}: "
                  f"{first_line[:300]}", file=sys.stderr)
    speeds = {mode: {config: 0.0 for config in built} for mode in FLAGS.modes}
    cpu = {mode: {} for mode in FLAGS.modes}
    cpu_rounds = {mode: {config: [] for config in built} for mode in FLAGS.modes}
    for _ in range(FLAGS.repeats):
        for mode in FLAGS.modes:
            for config, by_spe in built.items():
                model, x, y = by_spe[1]
                if mode == "step":
                    speed, cpu_ms = timed_steps(model, x, y)
                elif mode == "fit_spe":
                    speed, cpu_ms = timed_fit(
                        by_spe[FLAGS.steps_per_execution][0], fit_data, FLAGS.batch_size,
                        FLAGS.warmup_steps)
                else:
                    kwargs = fit_modes[mode](config)
                    speed, cpu_ms = timed_fit(model, kwargs.pop("data"),
                                              FLAGS.batch_size, FLAGS.warmup_steps,
                                              **kwargs)
                speeds[mode][config] = max(speeds[mode][config], speed)
                cpu[mode][config] = min(cpu[mode].get(config, cpu_ms), cpu_ms)
                cpu_rounds[mode][config].append(cpu_ms)
    return speeds, cpu, cpu_rounds


def noise_cpu_ms(model_name):
    """CPU ms of the noise of one private step alone: one Gaussian per
    trainable weight, keras-dp's sampler (`keras_dp.noise.add_gaussian_noise`),
    best of --repeats rounds of --steps draws."""
    import tensorflow as tf
    from keras_dp.noise import add_gaussian_noise
    model, _, _ = build(model_name, "keras", FLAGS.batch_size)
    weights = [tf.zeros(v.shape) for v in model.trainable_variables]

    @tf.function
    def noise(block):
        return add_gaussian_noise(weights, 1.0, tf.constant(1, tf.int64), block)

    noise(tf.constant(0, tf.int64))
    best = None
    for _ in range(FLAGS.repeats):
        cpu = time.process_time()
        for step in range(FLAGS.steps):
            result = noise(tf.constant(step, tf.int64))
        result[0].numpy()
        best = min(best or math.inf, 1000 * (time.process_time() - cpu) / FLAGS.steps)
    return best


def resident_mb():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_mb(model_name, config):
    """Peak resident memory (MB) of a few steps of one configuration, and its
    growth over the process with TensorFlow, Keras and keras_dp loaded."""
    import keras_dp  # noqa: F401
    from benchmarks import models  # noqa: F401
    before = resident_mb()
    model, x, y = build(model_name, config, FLAGS.memory_batch_size)
    for _ in range(FLAGS.warmup_steps + 2):
        model.train_on_batch(x, y)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak": peak, "growth": peak - before}


def tensor_peak_mb(model_name, config):
    """Peak MB of the tensors alive during two steps after warm-up, from
    TensorFlow's allocator statistics (the child runs with its CPU allocator
    counting: TF_CPU_ALLOCATOR_USE_BFC)."""
    import tensorflow as tf
    model, x, y = build(model_name, config, FLAGS.memory_batch_size)
    for _ in range(FLAGS.warmup_steps):
        model.train_on_batch(x, y)
    tf.config.experimental.reset_memory_stats("CPU:0")
    for _ in range(2):
        model.train_on_batch(x, y)
    return {"tensors": tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20}


def machine_description():
    import keras
    import tensorflow as tf
    return (f"{os.cpu_count()} logical CPUs, "
            f"{'GPU' if tf.config.list_physical_devices('GPU') else 'no GPU'}, "
            f"{platform.machine()}, Python {platform.python_version()}, "
            f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
            f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'unset')}")


def run_child(spec):
    mode, model_name, configs = spec.split(":")
    configs = configs.split(",")
    if mode == "speed":
        speeds, cpu, cpu_rounds = time_configs(model_name, configs)
        try:
            noise_ms = noise_cpu_ms(model_name)
        except Exception as error:  # The speeds stand without the bound.
            noise_ms = None
            print(f"[{model_name} noise] failed: {type(error).__name__}: {error}"[:300],
                  file=sys.stderr)
        result = {"speeds": speeds, "cpu_ms": cpu, "cpu_rounds": cpu_rounds,
                  "noise_cpu_ms": noise_ms,
                  "machine": machine_description()}
    elif mode == "tensors":
        result = tensor_peak_mb(model_name, configs[0])
    else:
        result = memory_mb(model_name, configs[0])
    print(json.dumps(result))


# ------------------------------------------------- in the parent process


def in_subprocess(mode, model_name, configs):
    """Runs one child (a fresh TensorFlow) and returns its JSON result."""
    command = [sys.executable, os.path.abspath(__file__),
               f"--child={mode}:{model_name}:{','.join(configs)}"]
    command += [f"--{name}={getattr(FLAGS, name)}" for name in
                ("batch_size", "memory_batch_size", "steps", "warmup_steps", "repeats",
                 "fit_examples", "sequence_length", "steps_per_execution")]
    command.append(f"--modes={','.join(FLAGS.modes)}")
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true") if mode == "tensors" else None
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    for line in done.stderr.splitlines():
        if line.startswith("["):
            print(line, file=sys.stderr)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    print(f"[{model_name} {mode} {','.join(configs)}] failed: {last[:300]}", file=sys.stderr)
    return {}


def ratio(value, reference):
    return f"{value / reference:.2f}" if value and reference else "-"


def _round_ratio_text(name, spread):
    return f"{name} {spread[0]:.2f} ({spread[1]:.2f}-{spread[2]:.2f})" if spread else ""


def report(model_name, speeds, memory, cpu_ms=None, noise_ms=None, cpu_rounds=None):
    """Prints one model's table; `speeds` maps each mode to {config: examples/s}."""
    best = {mode: max((by_config[c] for c in NON_PRIVATE if by_config.get(c)), default=None)
            for mode, by_config in speeds.items()}
    least = {key: min((memory[c][key] for c in NON_PRIVATE if memory.get(c, {}).get(key)),
                      default=None)
             for key in MEMORY_COLUMNS}
    columns = {mode: by_config for mode, by_config in speeds.items() if mode in TABLE_MODES}
    print(f"\nmodel={model_name}")
    print(f"{'configuration':<38}"
          + "".join(f" {mode + ' ex/s':>11} {'ratio':>6}" for mode in columns)
          + "".join(f" {title:>{width}} {'ratio':>6}"
                    for title, width in MEMORY_COLUMNS.values()))
    for config in FLAGS.configs:
        mem = memory.get(config) or {}
        line = f"{CONFIGS[config]:<38}"
        for mode, by_config in columns.items():
            speed = by_config.get(config)
            line += (f" {f'{speed:,.0f}' if speed else 'failed':>11}"
                     f" {ratio(speed, best[mode]):>6}")
        print(line + "".join(f" {mem.get(key, 0):>{width},.0f} {ratio(mem.get(key), least[key]):>6}"
                             for key, (_, width) in MEMORY_COLUMNS.items()))
    # Keras compiles without XLA by default on CPU: "private" is the default.
    default = next((c for c in DEFAULT_PRIVATE
                    if all(by_config.get(c) for by_config in speeds.values())), None)
    if not default:
        return
    mem = memory.get(default) or {}
    print(f"default private ({CONFIGS[default]}) / best non-private: "
          + ", ".join(f"{mode} speed {ratio(by_config[default], best[mode])}"
                      for mode, by_config in columns.items())
          + f", peak memory {ratio(mem.get('peak'), least['peak'])}, memory growth "
          f"{ratio(mem.get('growth'), least['growth'])}, tensor memory "
          f"{ratio(mem.get('tensors'), least['tensors'])}")
    step = speeds.get("step", {}).get(default)
    cpu_ms = cpu_ms or {}
    step_cpu = cpu_ms.get("step", {}).get(default)
    # The CPU time of a step of the expected batch moves far less with other
    # processes' load than its wall time: "CPU" ratios are step CPU ms over
    # the mode's (above 1: the mode costs less CPU per step).
    cpu_ratio = lambda mode: ratio(step_cpu, cpu_ms.get(mode, {}).get(default))  # noqa: E731
    if step and "fit" in speeds:
        # Issue 30's measure: what fit() keeps of the private step's speed.
        print(f"default private fit() / its own step: {ratio(speeds['fit'][default], step)}"
              f" (CPU {cpu_ratio('fit')})")
    for mode, title in FIT_VARIANTS.items():
        if mode in speeds:
            title = title.format(spe=FLAGS.steps_per_execution)
            least_cpu = min((cpu_ms.get(mode, {}).get(c) for c in NON_PRIVATE
                             if cpu_ms.get(mode, {}).get(c)), default=None)
            print(f"  {title + ':':<50} private / non-private "
                  f"{ratio(speeds[mode][default], best[mode])} (CPU "
                  f"{ratio(least_cpu, cpu_ms.get(mode, {}).get(default))}), / private step "
                  f"{ratio(speeds[mode][default], step)} (CPU {cpu_ratio(mode)}, "
                  f"{cpu_ms.get(mode, {}).get(default, 0):.1f} ms per step)")
    _report_rounds(cpu_rounds or {}, default)
    _report_bound(speeds, best, cpu_ms.get("step"), noise_ms, default)


def _report_rounds(cpu_rounds, default):
    """Per fit() mode, its CPU ratios within each round: median (range)."""
    step = cpu_rounds.get("step", {}).get(default)
    for mode in FIT_VARIANTS:
        by_config = cpu_rounds.get(mode, {})
        private = by_config.get(default)
        non_private = [min(values) for values in zip(*(by_config[c] for c in NON_PRIVATE
                                                       if by_config.get(c)))]
        parts = [_round_ratio_text("fit() / step", round_ratios(step, private)),
                 _round_ratio_text("private / non-private", round_ratios(non_private, private))]
        if any(parts):
            print(f"  {mode}, CPU within each of {len(private or [])} rounds, median (range): "
                  + ", ".join(part for part in parts if part))


def _report_bound(speeds, best, cpu_ms, noise_ms, default):
    """docs/performance.md's bound on 2 cores, re-measured in this run: a
    private step needs at least the non-private step's CPU time plus its
    noise's; with every core busy throughout it would run at
    cores * batch / that, over the best non-private fit()."""
    if not (cpu_ms and noise_ms and "fit" in speeds and best.get("fit")):
        return
    reference = max((c for c in NON_PRIVATE if speeds["fit"].get(c) and c in cpu_ms),
                    key=lambda c: speeds["fit"][c], default=None)
    if reference is None:
        return
    cores = os.cpu_count()
    bound = min(1.0, cores * FLAGS.batch_size * 1000 / (cpu_ms[reference] + noise_ms)
                / best["fit"])
    print(f"bound on {cores} cores ({CONFIGS[reference]} step {cpu_ms[reference]:.1f} ms "
          f"of CPU + noise {noise_ms:.1f} ms): private / non-private fit() <= {bound:.2f}; "
          + ", ".join(f"{mode} reaches {speeds[mode][default] / best[mode] / bound:.2f}"
                      for mode in FIT_VARIANTS if mode in speeds and best.get(mode))
          + " of it")


def main(argv):
    del argv
    if FLAGS.child:
        run_child(FLAGS.child)
        return
    for flag, known in (("configs", list(CONFIGS)), ("modes", MODES)):
        unknown = [value for value in FLAGS[flag].value if value not in known]
        if unknown:
            raise app.UsageError(f"unknown --{flag} {unknown}; choose among {known}")
    print(f"speed at batch {FLAGS.batch_size}, best of {FLAGS.repeats} rounds (step: "
          f"{FLAGS.steps} train_on_batch steps; fit: one epoch of {FLAGS.fit_examples} "
          f"examples), peak memory at batch {FLAGS.memory_batch_size}")
    for setting in FLAGS.onednn or [None]:
        if setting is not None:  # The children's TensorFlow reads it.
            os.environ["TF_ENABLE_ONEDNN_OPTS"] = setting
        run_models()


def run_models():
    """Measures and reports each of --models in fresh processes."""
    for model_name in FLAGS.models:
        result = in_subprocess("speed", model_name, FLAGS.configs)
        speeds = result.get("speeds", {mode: {} for mode in FLAGS.modes})
        cpu_ms, noise_ms = result.get("cpu_ms"), result.get("noise_cpu_ms")
        cpu_rounds = result.get("cpu_rounds")
        if "machine" in result and model_name == FLAGS.models[0]:
            print(result["machine"])
        memory = {}
        if FLAGS.memory:
            for config in FLAGS.configs:
                memory[config] = {**in_subprocess("memory", model_name, [config]),
                                  **in_subprocess("tensors", model_name, [config])}
        report(model_name, speeds, memory, cpu_ms, noise_ms, cpu_rounds)


if __name__ == "__main__":
    app.run(main)
