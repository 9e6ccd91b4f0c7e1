"""The keys a document's mappings may hold and the most items its lists may hold, read off its typed form, so that the
screen (``ppharness.document.yaml_limits``) refuses an unknown key as it reaches it, before walking the value under
it, and a list as soon as it grows past its field's ``max_length``."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from msgspec import inspect as mi


@dataclass
class Keys:
    """What a value may be as a mapping or a list: ``fields``, its keys and what each value may be (None: any key,
    left to the typed decoding); ``max_items``, the most items as a list, and ``items``, what each item may be
    (None: not checked)."""

    fields: dict[str, Keys | None] | None = field(default_factory=dict)
    items: Keys | None = None
    max_items: int | None = None

    def value_of(self, key: str) -> Keys | None:
        """What the value under ``key`` may be (None: not checked)."""
        return None if self.fields is None else self.fields.get(key)


@functools.cache
def keys_of(root: type, extra: tuple[tuple[str, str], ...] = ()) -> Keys:
    """The keys of ``root`` (a msgspec struct type); ``extra``: (struct name, key) pairs that a struct also accepts in
    the file (a convenience turned into its fields before the typed decoding, e.g. an op's ``blocks: 0..6``)."""
    found = _keys(mi.type_info(root), dict(_group(extra)))
    return found if found is not None else Keys(fields=None)


def _group(extra: tuple[tuple[str, str], ...]) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for name, key in extra:
        out[name] = (*out.get(name, ()), key)
    return out


def _flat(t: mi.Type) -> list[mi.Type]:
    if isinstance(t, mi.Metadata):
        return _flat(t.type)
    if isinstance(t, mi.UnionType):
        return [u for v in t.types for u in _flat(v)]
    return [t]


def _keys(t: mi.Type, extra: dict[str, tuple[str, ...]]) -> Keys | None:
    out = Keys()
    structs, mappings, lists = [], False, []
    for u in _flat(t):
        if isinstance(u, mi.StructType):
            structs.append(u)
        elif isinstance(u, mi.DictType):
            mappings = True
        elif isinstance(u, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
            lists.append(u)
        elif isinstance(u, mi.AnyType):
            return None
    if mappings or not structs or not all(u.forbid_unknown_fields for u in structs):
        out.fields = None
    else:
        out.fields = {}
        for s in structs:
            if isinstance(s.tag_field, str):
                out.fields[s.tag_field] = None
            for f in s.fields:
                out.fields[f.encode_name] = _keys(f.type, extra)
            for key in extra.get(s.cls.__name__, ()):
                out.fields.setdefault(key, None)
    if lists:
        out.items = _keys(lists[0].item_type, extra) if len(lists) == 1 else None
        bounds = [u.max_length for u in lists if not isinstance(u, (mi.SetType, mi.FrozenSetType))]
        out.max_items = max(bounds) if bounds and None not in bounds else None  # type: ignore[type-var]
    return out
