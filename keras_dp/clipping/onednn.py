"""Whether TensorFlow runs its oneDNN CPU kernels: both engines pick ops by
it; and which ops XLA, which replaces them, cannot compile."""

import functools

import tensorflow as tf

# A function's inputs: XLA takes them as arguments, not as kernels.
_FUNCTION_INPUTS = frozenset({"Placeholder", "_Arg"})


def runs_on_onednn():
    """Whether ops traced here would run on TensorFlow's oneDNN CPU kernels.

    TensorFlow turns oneDNN on by default on x86 CPUs with AVX512_VNNI,
    AVX512_BF16 or AMX, off elsewhere; TF_ENABLE_ONEDNN_OPTS=0/1 forces it.
    Ops compiled by XLA (jit_compile=True) never run on them.
    """
    try:
        from tensorflow.python.ops import control_flow_util
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:  # Internals moved in a later TensorFlow: assume the unsafe case.
        return True
    in_xla = control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    return bool(_pywrap_util_port.IsMklEnabled()) and not in_xla


def first_op_without_xla_kernel(ops):
    """The first of `ops` that XLA has no CPU kernel for, or None (also when
    this TensorFlow's kernel registry cannot be read: XLA's own error then
    stands)."""
    try:
        from tensorflow.python.framework import kernels
        _register_xla_kernels()
    except (ImportError, tf.errors.OpError):
        return None
    return next((op for op in ops if op.type not in _FUNCTION_INPUTS
                 and not _has_xla_kernel(kernels, op.type)), None)


@functools.cache
def _register_xla_kernels():
    """TensorFlow registers XLA's kernels as it first compiles a function."""
    with tf.init_scope():
        tf.function(lambda: tf.zeros([]), jit_compile=True)()


@functools.cache
def _has_xla_kernel(kernels, op_type):
    return any(kernel.device_type == "XLA_CPU_JIT"
               for kernel in kernels.get_registered_kernels_for_op(op_type).kernel)
