"""YAML a training pod wrote (``replicator.yaml``), parsed within bounds of time and memory.

PyYAML's loaders build an alias as a reference to its anchor's object, so a few hundred bytes of
nested aliases describe 10^10 list items (an "alias bomb"): cheap to parse, ruinous to walk, compare
or print. ``load`` is ``yaml.CSafeLoader`` (libyaml's parser, PyYAML's safe constructor) with one
change, in its composer: an anchor, an alias, or nesting deeper than ``MAX_DEPTH`` is refused where
the parser meets it, before it reads on. Without aliases every node of the result is a distinct
piece of the text, so the caller's cap on the file's size (64 KiB) bounds the time and memory of the
parse: milliseconds for a real file, about 0.3 s for the slowest 64 KiB found (a flow list of 30,000
integers; 0.5 s for one base-60 integer of 30,000 digits, which PyYAML 1.1 still reads), on one core
of a busy 2-core machine.

No message here holds more than a short prefix of anything the pod wrote (``describe``)."""

import yaml
from yaml.composer import Composer
from yaml.events import AliasEvent

# replicator.yaml is a mapping holding a list of integers (peer-ranks): depth 3, the integers counted.
# Room for more, far below the recursion limit that PyYAML's recursive composer would hit.
MAX_DEPTH = 8
# The longest piece of a pod's string, and the most list items, an error message shows.
_PREFIX_CHARS = 64
_LIST_ITEMS = 8
_MAX_MESSAGE_CHARS = 512
# The problem libyaml's scanner names when flow collections nest over 1,000 levels.
LIBYAML_TOO_DEEP = "exceeded maximum nesting depth"


class RefusedYaml(ValueError):
    """The text is not YAML the agent reads; the message says why and where, in bounded length.

    Attributes:
      final: True when the text read so far is refused whatever follows it (an anchor, an alias,
        nesting deeper than ``MAX_DEPTH``): a file still being written cannot become valid. False
        for any other error (unterminated, a bad value), which a half-written file may show.
    """

    def __init__(self, message: str, final: bool = False):
        super().__init__(bounded(message))
        self.final = final


class _BoundedComposer(Composer):
    """PyYAML's composer, refusing anchors, aliases and deep nesting as it meets them."""

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()  # type: ignore[attr-defined]  # the parser's, a base of _PodLoader
        if isinstance(event, AliasEvent) or event.anchor is not None:
            kind = "an alias" if isinstance(event, AliasEvent) else "an anchor"
            raise RefusedYaml(
                f"{kind} ({describe(event.anchor)}) {_at(event.start_mark)}: anchors and aliases are refused",
                final=True,
            )
        if self._depth >= MAX_DEPTH:
            raise RefusedYaml(_too_deep(event.start_mark), final=True)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _PodLoader(_BoundedComposer, yaml.CSafeLoader):
    """``yaml.CSafeLoader`` (libyaml's parser, PyYAML's safe constructor and resolver) composing with
    ``_BoundedComposer`` in Python: its methods come first, before libyaml's composer, which takes
    every alias."""

    def __init__(self, stream: str):
        yaml.CSafeLoader.__init__(self, stream)
        _BoundedComposer.__init__(self)


def load(text: str) -> object:
    """The one YAML document of ``text``, as ``yaml.safe_load`` builds it (None for an empty document).

    Raises:
      RefusedYaml: not one YAML document, an anchor or alias, nesting deeper than ``MAX_DEPTH``, or a
        scalar its tag cannot take (an integer of over 4,300 digits, the 13th month).
    """
    loader = _PodLoader(text)
    try:
        return loader.get_single_data()
    except RefusedYaml:
        raise
    except yaml.MarkedYAMLError as err:
        if err.problem == LIBYAML_TOO_DEEP and err.problem_mark is not None:
            # libyaml's own bound, met where one line opens 1,000 flow collections before the composer
            # reads the first ones: as final as the composer's.
            raise RefusedYaml(_too_deep(err.problem_mark), final=True) from None
        raise RefusedYaml(f"not valid YAML: {err}") from None
    except yaml.YAMLError as err:
        raise RefusedYaml(f"not valid YAML: {err}") from None
    except ValueError as err:  # a constructor's int() or date(): PyYAML lets them through
        raise RefusedYaml(f"not valid YAML: {err}") from None
    finally:
        loader.dispose()


def _at(mark) -> str:
    return f"at line {mark.line + 1}, column {mark.column + 1}"


def _too_deep(mark) -> str:
    return f"nesting deeper than {MAX_DEPTH} levels {_at(mark)}"


def describe(value: object) -> str:
    """``value`` (from a pod's YAML) for an error message, in bounded length and time: a scalar or a
    short prefix of it, the first items of a list of scalars, else its type and size. Never the
    ``str`` of a structure."""
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, str):
        return repr(value[:_PREFIX_CHARS]) + (f"... ({len(value)} characters)" if len(value) > _PREFIX_CHARS else "")
    if isinstance(value, (list, tuple)):
        if all(item is None or isinstance(item, (bool, int, float)) for item in value[:_LIST_ITEMS]):
            shown = ", ".join(describe(item) for item in value[:_LIST_ITEMS])
            return f"[{shown}]" if len(value) <= _LIST_ITEMS else f"[{shown}, ...] ({len(value)} items)"
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return f"a mapping of {len(value)} keys"
    return f"a value of type {type(value).__name__}"


def bounded(message: str, limit: int = _MAX_MESSAGE_CHARS) -> str:
    """``message`` cut to ``limit`` characters (512): what a pod's file can put into an error's text."""
    return message if len(message) <= limit else message[:limit] + "..."
