"""Which norm function handles which layer, and the helpers norm functions share.

Built-in norm functions are in `keras_dp.clipping.layers`, one module per
layer family; each registers its own with `register_norm_function`.
"""

import importlib
import types

import keras


class UnsupportedModelError(ValueError):
    """Raised while tracing when ghost clipping cannot be exact for a model.

    (A weight read outside the norm functions, add_loss() terms.) Nothing has
    changed when it is raised: the caller may fall back to the vectorized
    engine in the same trace.
    """


_REGISTRY = {}
# Norm functions for an optional library's layers, imported the first time
# the engine meets one of its layers (so the library stays optional): the
# prefix of the layers' module -> the module that registers them.
_LAZY_PLUGINS = {}

# Methods that configure, save or describe a layer without computing its
# outputs: a subclass defining only these computes what its registered class
# does. `build` is not one: it makes the weights the forward pass reads.
NON_COMPUTATIONAL_METHODS = frozenset(["__init__", "get_config", "from_config",
                                       "compute_output_shape"])


def register_norm_function(layer_class, fn, applies_to=None):
    """Registers how ghost clipping handles the weights of `layer_class`.

    The function replaces `layer.call` during the recorded forward pass:

        outputs, watched, gradients_fn = fn(layer, args, kwargs)

    * `args`, `kwargs`: the arguments `layer.call` received.
    * `outputs`: what `layer.call(*args, **kwargs)` returns (same values).
    * `watched`: a tensor or list of tensors computed inside `fn`, whose
      gradients determine the per-example gradients of the layer's weights;
      typically the pre-activation output. Row i of every watched tensor and
      of the outputs must depend on example i only.
    * `gradients_fn(watched_grads)`: given the gradient of the summed
      per-example loss w.r.t. `watched` (same structure; row i of each is
      example i's because examples are independent), returns a list of
      `(variable, factor)` pairs, one factor (`OuterProduct`, `PerExample` or
      `GatheredRows`) describing the per-example gradient of `variable`
      through THIS call. Report every trainable weight `fn` reads: an
      unreported read raises an error. Frozen weights may be reported or not.

    A layer called several times in one forward pass, or a variable reported
    by several layers, is handled by the engine (factors of one variable are
    summed exactly, cross terms included), so `fn` only describes one call.

    A subclass of `layer_class` uses `fn` too only when it computes what
    `layer_class` does: it and every class between them define no method but
    those of `NON_COMPUTATIONAL_METHODS`. Overriding anything else (`call`, a
    `convolution_op` standardizing the kernel, `build`, a property) makes the
    layer unsupported until the subclass is registered itself.

    Args:
        layer_class: a `keras.layers.Layer` subclass.
        fn: the norm function described above.
        applies_to: optional `layer -> bool`; False makes the layer (hence a
            model containing it) unsupported, e.g. for a configuration `fn`
            does not handle.

    Example (a layer adding a learned `[T, D]` position embedding):
    ```python
    def position_embedding_norm(layer, args, kwargs):
        outputs = args[0] + layer.position_embeddings[None]
        def gradients(grad):
            return [(layer.position_embeddings, keras_dp.PerExample(grad))]
        return outputs, outputs, gradients

    keras_dp.register_norm_function(PositionEmbedding, position_embedding_norm)
    ```
    """
    if not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
        raise TypeError(f"register_norm_function expects a keras.layers.Layer subclass; "
                        f"received {layer_class!r}.")
    if not callable(fn):
        raise TypeError(f"The norm function must be callable; received {fn!r}.")
    _REGISTRY[layer_class] = (fn, applies_to)


def rule_for(layer):
    """The registered norm function that applies to `layer`, or None.

    Args:
        layer: a Keras layer.

    Returns:
        The norm function of `registered_class(type(layer))`, if `layer`
        computes what that class does (no `computational_methods`) and its
        `applies_to` accepts it; else None.
    """
    registered = registered_class(type(layer))
    if (registered is None or computational_methods(type(layer), registered)
            or replaced_methods(layer)):
        return None  # No norm function, or one written for another computation.
    fn, applies_to = _REGISTRY[registered]
    if applies_to is not None and not applies_to(layer):
        return None
    return fn


def registered_class(layer_type):
    """The nearest class of `layer_type`'s MRO with a norm function, or None."""
    _load_plugins_for(layer_type)
    return next((cls for cls in layer_type.__mro__ if cls in _REGISTRY), None)


def register_lazy_plugin(layer_module_prefix, plugin_module):
    """Registers the norm functions of an optional library lazily.

    Args:
        layer_module_prefix: the start of the module name of the library's
            layers, e.g. `"keras_hub."`.
        plugin_module: the module whose import registers their norm
            functions (`register_norm_function`), imported the first time a
            layer of that library is looked up.
    """
    _LAZY_PLUGINS[layer_module_prefix] = plugin_module


def _load_plugins_for(layer_type):
    for prefix in [p for p in _LAZY_PLUGINS if layer_type.__module__.startswith(p)]:
        importlib.import_module(_LAZY_PLUGINS.pop(prefix))


def computational_methods(layer_type, registered):
    """The methods by which `layer_type` may compute otherwise than `registered`.

    Args:
        layer_type: a subclass of `registered` (or `registered` itself).
        registered: a class with a norm function.

    Returns:
        The sorted names of the methods, properties and other callables that
        `layer_type` or a class between it and `registered` defines, except
        `NON_COMPUTATIONAL_METHODS`; empty when `layer_type` computes what
        `registered` does.
    """
    mro = layer_type.__mro__
    between = mro[:mro.index(registered)]
    return sorted({name for cls in between for name, value in vars(cls).items()
                   if (callable(value) or isinstance(value, (property, staticmethod, classmethod)))
                   and name not in NON_COMPUTATIONAL_METHODS})


def replaced_methods(layer):
    """The methods of its class that `layer` replaces on the object itself
    (`layer.call = f`), which a norm function written for the class does not
    compute (review round 125: a Dense whose call was set on the object was
    clipped as a plain Dense, 3.97 from the true clipped sum). Keras' own
    wrappers of `build` and `quantize`, set on every layer, are not."""
    return sorted(name for name, value in vars(layer).items()
                  if callable(value) and callable(getattr(type(layer), name, None))
                  and name not in NON_COMPUTATIONAL_METHODS
                  and not _wraps_the_class_method(layer, name, value))


def _wraps_the_class_method(layer, name, value):
    """Whether `value` is Keras' own wrapper of the class's `name` method of
    `layer`, by its code: a function of the user's that says it wraps it
    (`functools.wraps`) is not (review round 127: a get_initial_state
    returning a batch statistic, 15.27 C)."""
    wrapped = getattr(value, "__wrapped__", None)
    return (getattr(value, "__code__", None) in _KERAS_WRAPPERS
            and getattr(wrapped, "__self__", None) is layer
            and getattr(wrapped, "__func__", None) is getattr(type(layer), name))


# The functions Keras' Layer.__new__ sets on each layer object around its
# class's build and quantize.
_KERAS_WRAPPERS = frozenset(code for code in keras.layers.Layer.__new__.__code__.co_consts
                            if isinstance(code, types.CodeType))


def first_input(args, kwargs):
    """The inputs a norm function's layer was called with."""
    return args[0] if args else kwargs["inputs"]


def unquantized(layer):
    """An `applies_to` for layers whose norm function reads float weights only."""
    return getattr(layer, "quantization_mode", None) is None
