"""A small JAX-like tree API over ``torch.utils._pytree``, and the decorator for batch pytrees.

Batches in rlfunc are frozen ``attrs`` classes registered as torch pytrees, so ``tree_map`` reaches
every tensor inside them (``None`` fields are empty subtrees) and ``torch.func`` transforms accept them.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import attrs
import torch.utils._pytree as _pytree

__all__ = [
    "pytree_dataclass",
    "tree_map",
    "tree_leaves",
    "tree_flatten",
    "tree_unflatten",
    "tree_structure",
]

T = TypeVar("T")

tree_leaves = _pytree.tree_leaves
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_structure = _pytree.tree_structure


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Apply ``fn`` to every leaf of ``tree`` (and the matching leaves of ``rest``), like ``jax.tree.map``."""
    return _pytree.tree_map(fn, tree, *rest)


def pytree_dataclass(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen ``attrs`` class registered as a torch pytree node.

    Every attribute is a child of the node (tensors, ``None`` or nested pytrees). Instances gain
    ``replace(**changes)``, which returns a new object and leaves the original untouched.
    """
    cls = attrs.frozen(cls, kw_only=True)
    names = tuple(f.name for f in attrs.fields(cls))

    # As in JAX, a field holding ``None`` is an empty subtree, not a leaf: the names of the present
    # fields are the node's context, so batches with different fields set have different structures.
    def present(obj: Any) -> tuple[str, ...]:
        return tuple(n for n in names if getattr(obj, n) is not None)

    def flatten(obj: Any) -> tuple[list[Any], tuple[str, ...]]:
        context = present(obj)
        return [getattr(obj, n) for n in context], context

    def unflatten(values: Any, context: tuple[str, ...]) -> Any:
        # Bypass __init__ and validators: transforms such as vmap unflatten with placeholder leaves.
        obj = object.__new__(cls)
        given = dict(zip(context, values))
        for n in names:
            object.__setattr__(obj, n, given.get(n))
        return obj

    def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], tuple[str, ...]]:
        context = present(obj)
        return [(_pytree.GetAttrKey(n), getattr(obj, n)) for n in context], context

    _pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )

    def replace(self: T, **changes: Any) -> T:
        return attrs.evolve(self, **changes)

    cls.replace = replace  # type: ignore[attr-defined]
    return cls
