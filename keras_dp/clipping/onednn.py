"""Whether TensorFlow runs its oneDNN CPU kernels: both engines pick ops by it."""

import tensorflow as tf


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
