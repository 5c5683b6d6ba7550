"""Random JSON schemas within the subset structured outputs support (hypothesis
strategies), for the engine's and the server's property tests alike.

Strings and arrays are bounded, as a client that wants an answer bounds them: at
temperature 1.0 a small model otherwise writes until max_tokens.
"""

from __future__ import annotations

from hypothesis import strategies as st

_NAMES = st.sampled_from(["name", "age", "city", "tags", "ok", "score", "id", "note"])
_LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 10)),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 1000),
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(
        lambda xs: {"enum": xs},
        st.lists(st.sampled_from(["red", "green", 3, None]), min_size=1, max_size=3, unique=True),
    ),
)


def _object(values: st.SearchStrategy) -> st.SearchStrategy:
    """An object of 1-3 properties drawn from `values`, some required, nothing else allowed."""
    props = st.dictionaries(_NAMES, values, min_size=1, max_size=3)
    return props.flatmap(
        lambda p: st.builds(
            lambda required: {
                "type": "object",
                "properties": p,
                "required": sorted(required),
                "additionalProperties": False,
            },
            st.sets(st.sampled_from(sorted(p))),
        )
    )


_VALUES = st.one_of(
    _LEAVES,
    st.builds(
        lambda items, n: {"type": "array", "items": items, "maxItems": n},
        _LEAVES,
        st.integers(0, 3),
    ),
)
SCHEMAS = _object(st.one_of(_VALUES, _object(_LEAVES)))
"""An object schema: leaves, bounded arrays of leaves, or objects of leaves as values."""
