"""Limits that stop a runaway chat template: wall time, Stop, output and value sizes, recursion depth.

A chat template is code from a downloaded file. jinja2's sandbox keeps it away from Python internals but not
from burning time or memory: two nested `range(99999)` loops run for hours, `'x' * 10**10` asks for 10 GB, and
a macro that calls itself ends in a RecursionError deep inside the worker. While a render runs in a thread, a
RenderGuard:

- is ticked by the compiled template itself: the code generator below writes a check at the start of every
  scope the template enters (each loop iteration, macro, call block), which tests the deadline and the cancel
  callback and counts the template frames on the stack. (A sys.settrace tracer limited to template frames
  did the same at several times the render time of real templates: bench/template_guard.py, RELIABILITY.md.)
- checks every value the template builds through an operator, a call, a filter, `~` or `{{ }}`: before the
  work where its size can be known (a repeat count, a width, a power), after it otherwise, and the running
  total of what it built.

Sizes are the characters a value prints as (its "weight"), so `[s] * n` weighs n copies of `s`. The
environment below routes the operators, calls, filters and concatenation through these checks; the checks that
need no guard (widths, powers) also run when jinja2 folds constants at compile time.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable
from functools import wraps

from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

TEMPLATE_FILENAME = "<template>"  # the code filename jinja2 gives templates compiled from a string

# Limits, with why. A value or an output may be 4 times what the template was given plus 4 Mi characters: the
# messages with a header each, tool schemas and a long system prompt fit many times over. The running total
# of everything built may be 16 of those (templates split and strip each message a few times). 10 s is
# thousands of times what a real template takes; 64 nested template frames is far beyond any recursive tool
# schema. Integers stay under 4,096 bits (templates count messages, not factorials).
RENDER_TIMEOUT_S = 10.0
BASE_VALUE_CHARS = 4 * 1024**2
INPUT_FACTOR = 4
TOTAL_FACTOR = 16
MAX_TEMPLATE_DEPTH = 64
MAX_INT_BITS = 4096
MAX_JSON_INDENT = 64  # tojson(indent=...) and separators: real templates use 2 or 4
MAX_FORMAT_WIDTH = 10_000  # a width or precision in '%'- or str.format-formatting

_local = threading.local()


class TemplateAbort(BaseException):
    """Raised inside a render to stop it (a BaseException, so no `except Exception` in jinja2 or a filter can
    swallow it). `reason` says why in words; `cancelled` is True for Stop."""

    def __init__(self, reason: str, cancelled: bool = False):
        super().__init__(reason)
        self.reason, self.cancelled = reason, cancelled


class RenderGuard:
    """The limits of one render. Use as a context manager in the rendering thread."""

    def __init__(self, input_chars: int = 0, cancel: Callable[[], bool] | None = None,
                 timeout_s: float | None = None):
        self.max_value = BASE_VALUE_CHARS + INPUT_FACTOR * max(0, input_chars)
        self.max_total = TOTAL_FACTOR * self.max_value
        self.timeout_s = RENDER_TIMEOUT_S if timeout_s is None else timeout_s
        self.cancel = cancel
        self.total = 0
        self.deadline = 0.0
        self._base = None  # the frame that entered the guard: stack walks stop there
        self._outer: RenderGuard | None = None

    def __enter__(self) -> RenderGuard:
        self.deadline = time.monotonic() + self.timeout_s
        self._base = sys._getframe(1)
        self._outer = getattr(_local, "guard", None)
        _local.guard = self
        return self

    def __exit__(self, *exc) -> None:
        _local.guard = self._outer
        self._base = None

    def tick(self) -> None:
        if self.cancel is not None and self.cancel():
            raise TemplateAbort("stopped", cancelled=True)
        if time.monotonic() > self.deadline:
            raise TemplateAbort(f"it ran longer than {self.timeout_s:g} s (a loop that does not end?)")

    def enter_scope(self) -> None:
        """Called by the template at the start of each scope: tick, and count template frames on the stack."""
        self.tick()
        frame, depth = sys._getframe(2), 0
        while frame is not None and frame is not self._base:
            if frame.f_code.co_filename == TEMPLATE_FILENAME:
                depth += 1
                if depth > MAX_TEMPLATE_DEPTH:
                    raise TemplateAbort(f"it nests deeper than {MAX_TEMPLATE_DEPTH} levels (a macro or loop "
                                        "calling itself)")
            frame = frame.f_back

    # --- sizes --------------------------------------------------------------------------------------------------
    def built(self, value, what: str) -> None:
        w = weight(value, self.max_value)
        if w > self.max_value:
            raise TemplateAbort(f"{what} would be longer than {self.max_value:,} characters")
        self.total += w
        if self.total > self.max_total:
            raise TemplateAbort(f"it built more than {self.max_total:,} characters of text and lists in all")
        self.tick()


def active() -> RenderGuard | None:
    return getattr(_local, "guard", None)


def max_value() -> int:
    guard = active()
    return guard.max_value if guard is not None else BASE_VALUE_CHARS


def built(value, what: str):
    """Check a value the template made (size and running total, then the deadline); returns it."""
    guard = active()
    if guard is not None:
        guard.built(value, what)
    elif weight(value, BASE_VALUE_CHARS) > BASE_VALUE_CHARS:  # compile-time folding: no guard, static limit
        raise TemplateAbort(f"{what} would be longer than {BASE_VALUE_CHARS:,} characters")
    return value


def refuse_over(size: int, what: str) -> None:
    limit = max_value()
    if size > limit:
        raise TemplateAbort(f"{what} would be longer than {limit:,} characters")


def weight(value, limit: int) -> int:
    """About the characters str(value) has, counted only up to `limit` (then limit + 1). Containers count their
    items, every time they appear (a list holding one string n times weighs n strings). Each step adds to the
    total before it walks on, so even a cycle ends at the limit."""
    if type(value) is str:  # the common case, first
        return len(value)
    total = 0
    stack = [value]
    while stack:
        v = stack.pop()
        kind = type(v)  # type(), not isinstance(): a Namespace answers every attribute lookup in Python
        if issubclass(kind, str):
            total += len(v)
        elif kind is bool or kind is float or v is None:
            total += 24
        elif issubclass(kind, int):
            total += v.bit_length() // 3 + 2
        elif issubclass(kind, (bytes, bytearray)):
            total += 4 * len(v)
        elif issubclass(kind, (list, tuple, set, frozenset, dict, Namespace)):
            if issubclass(kind, Namespace):
                v = object.__getattribute__(v, "_Namespace__attrs")
            items = list(v.items()) if issubclass(type(v), dict) else v
            total += 8 + 8 * len(items)  # brackets, quotes, commas; also keeps a walk over a cycle short
            if total > limit:
                return limit + 1
            stack.extend(items)
        else:
            total += 64  # an object that prints as its short repr (a macro, Undefined, a loop)
        if total > limit:
            return limit + 1
    return total


# --- the checks before the work ------------------------------------------------------------------------------

def check_binop(operator: str, left, right) -> None:
    if operator == "+" and type(left) is str and type(right) is str:  # the common case, first
        refuse_over(len(left) + len(right), "joining two values with +")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if right * abs(left).bit_length() > MAX_INT_BITS:
            raise TemplateAbort(f"{left!r:.20} ** {right!r:.20} is a number of more than {MAX_INT_BITS} bits")
    elif operator == "*":
        if isinstance(left, int) and isinstance(right, int) and not isinstance(left, bool):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateAbort(f"a product of more than {MAX_INT_BITS} bits")
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and n > 1:
                refuse_over(weight(seq, max_value()) * n, f"repeating a value {n:,} times")
    elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        limit = max_value()
        refuse_over(weight(left, limit) + weight(right, limit), "joining two values with +")
    elif operator == "%" and isinstance(left, str):
        check_printf(left)


_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACES = re.compile(r"\{([^{}]*)\}")


def check_printf(fmt: str) -> None:
    for width, precision in _PRINTF.findall(fmt):
        for field in (width, precision):
            if field == "*" or (field and int(field) > MAX_FORMAT_WIDTH):
                raise TemplateAbort(f"a '%' format width or precision over {MAX_FORMAT_WIDTH:,}")


def check_str_format(fmt: str) -> None:
    plain = fmt.replace("{{", "").replace("}}", "")
    if re.search(r"\{[^{}]*\{", plain):
        raise TemplateAbort("a format field inside a format field (its width would come from the data)")
    for field in _BRACES.findall(plain):
        spec = field.partition(":")[2]
        if any(int(n) > MAX_FORMAT_WIDTH for n in re.findall(r"\d+", spec)):
            raise TemplateAbort(f"a format width or precision over {MAX_FORMAT_WIDTH:,}")


def _width(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def check_str_method(obj, name: str, args: tuple) -> None:
    """Bounds for the str methods whose result can be far larger than the string."""
    if name in ("ljust", "rjust", "center", "zfill") and args:
        refuse_over(_width(args[0]), f"str.{name}({args[0]!r:.20})")
    elif name == "expandtabs":
        refuse_over(len(obj) * max(1, _width(args[0]) if args else 8), "str.expandtabs")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        hits = obj.count(args[0]) if args[0] else len(obj) + 1
        if len(args) > 2 and _width(args[2]) >= 0 and isinstance(args[2], int):
            hits = min(hits, args[2]) if args[2] >= 0 else hits
        refuse_over(len(obj) + hits * len(args[1]), "str.replace")
    elif name in ("format", "format_map"):
        check_str_format(obj)


# --- filters and globals ---------------------------------------------------------------------------------------

def _filter_precheck(name: str, args: tuple, kwargs: dict) -> None:
    value = args[0] if args else None
    rest = args[1:]
    if name == "center":
        refuse_over(_width(rest[0] if rest else kwargs.get("width", 80)), "the center filter")
    elif name == "indent":
        width = rest[0] if rest else kwargs.get("width", 4)
        step = len(width) if isinstance(width, str) else _width(width)
        lines = str(value).count("\n") + 1 if isinstance(value, str) else 1
        refuse_over(step * lines + weight(value, max_value()), "the indent filter")
    elif name == "format" and isinstance(value, str):
        check_printf(value)
    elif name == "replace" and isinstance(value, str) and len(rest) >= 2:
        check_str_method(value, "replace", tuple(rest))
    elif name == "tojson":
        indent = kwargs.get("indent", rest[1] if len(rest) > 1 else None)
        separators = kwargs.get("separators", rest[2] if len(rest) > 2 else None)
        if isinstance(indent, str) and len(indent) > MAX_JSON_INDENT or _width(indent) > MAX_JSON_INDENT:
            raise TemplateAbort(f"tojson indent over {MAX_JSON_INDENT}")
        if separators is not None and weight(separators, MAX_JSON_INDENT) > MAX_JSON_INDENT:
            raise TemplateAbort(f"tojson separators longer than {MAX_JSON_INDENT}")
    elif name in ("slice", "batch"):
        refuse_over(_width(rest[0] if rest else kwargs.get("slices", kwargs.get("linecount", 1))),
                    f"the {name} filter's count")
    elif name == "sum":
        start = kwargs.get("start", rest[1] if len(rest) > 1 else 0)
        if not isinstance(start, (int, float)):
            raise TemplateAbort("the sum filter on values that are not numbers")
    if value is not None and name not in ("length", "count", "first", "last", "default", "d"):
        refuse_over(weight(value, max_value()), f"the input of the {name} filter")


def guarded_filter(name: str, fn):
    @wraps(fn)  # keeps jinja2's pass_context/pass_eval_context marks
    def run(*args, **kwargs):
        passed = getattr(fn, "jinja_pass_arg", None)
        _filter_precheck(name, args[1:] if passed is not None else args, kwargs)
        return built(fn(*args, **kwargs), f"the result of the {name} filter")

    return run


def bounded_lipsum(lipsum):
    @wraps(lipsum)
    def run(n=5, html=True, min=20, max=100):  # noqa: A002 - jinja2's own parameter names
        refuse_over(_width(n) * _width(max) * 12, "lipsum()")
        return built(lipsum(n, html, min, max), "lipsum()")

    return run


# --- the environment ---------------------------------------------------------------------------------------------

class GuardedCodeGenerator(CodeGenerator):
    """Each scope the template enters starts with environment.guard_scope(); `a ~ b` goes through
    environment.guarded_concat instead of a bare str_join."""

    def enter_frame(self, frame) -> None:
        super().enter_frame(frame)
        self.writeline("environment.guard_scope()")

    def visit_Concat(self, node, frame) -> None:  # noqa: N802 - jinja2's visitor name
        self.write("environment.guarded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every operator that can grow a value, every call, filter, `~` and `{{ }}` checked."""

    code_generator_class = GuardedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})  # also stops jinja2 folding them at compile time

    def __init__(self, **options):
        super().__init__(finalize=self._finalize, **options)
        self.filters = {name: guarded_filter(name, fn) for name, fn in self.filters.items()}
        self.globals["lipsum"] = bounded_lipsum(self.globals["lipsum"])

    @staticmethod
    def _finalize(value):
        return built(value, "a printed value")

    @staticmethod
    def guard_scope() -> None:
        guard = active()
        if guard is not None:
            guard.enter_scope()

    @staticmethod
    def guarded_concat(values: tuple) -> str:
        limit = max_value()
        refuse_over(sum(weight(v, limit) for v in values), "joining values with ~")
        return built("".join(map(str, values)), "joining values with ~")

    def call_binop(self, context, operator, left, right):
        check_binop(operator, left, right)
        return built(super().call_binop(context, operator, left, right), f"the result of {operator}")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            check_str_method(owner, getattr(__obj, "__name__", ""), args)
        return built(super().call(__context, __obj, *args, **kwargs), "the result of a call")

    def wrap_str_format(self, value):
        owner = getattr(value, "__self__", None)
        if isinstance(owner, str) and getattr(value, "__name__", "") in ("format", "format_map"):
            check_str_format(owner)
        return super().wrap_str_format(value)

    def concat(self, parts) -> str:  # noqa: D401 - macros, call blocks and {% set %} blocks join here
        parts = list(parts)
        refuse_over(sum(len(p) for p in parts), "a block of template output")
        return "".join(parts)
