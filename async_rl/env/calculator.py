"""A calculator MCP server: `python -m async_rl.env.calculator [--log PATH]` serves it on stdio.

Owns: the one tool, `calculate(expression)`, and its evaluator: arithmetic on integer and
decimal literals with + - * / // % ** and parentheses, parsed with `ast` (never `eval`), bounded
in length and size so no expression can run long or allocate much. Does not own: calling it
(`env.mcp`, with `rollout.env=mcp rollout.mcp_server="python -m async_rl.env.calculator"`).

`--log PATH` appends one JSON line per call (`{"expression", "result", "idempotency_key"}`), so
a test or a person can count the calls a run made.
"""

import argparse
import ast
import json
import operator
import os
import threading
from fractions import Fraction
from typing import Optional

from async_rl.errors import UsageError

MAX_CHARS = 200  # characters of one expression
MAX_DIGITS = 60  # digits of any intermediate value (numerator or denominator)
MAX_EXPONENT = 64  # |b| in a ** b

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(UsageError):
    """An expression the calculator refuses (bad input from the policy): one line it reads as the tool's result."""


def _size_ok(x: Fraction) -> Fraction:
    if len(str(abs(x.numerator))) > MAX_DIGITS or len(str(x.denominator)) > MAX_DIGITS:
        raise CalcError(f"a value has more than {MAX_DIGITS} digits")
    return x


def _power(a: Fraction, b: Fraction) -> Fraction:
    if b.denominator != 1:
        raise CalcError("only whole-number exponents")
    if abs(b) > MAX_EXPONENT:
        raise CalcError(f"exponent above {MAX_EXPONENT}")
    # an estimate before computing: |a| ** b with a's digits times b past the bound is refused
    if len(str(abs(a.numerator))) * abs(int(b)) > MAX_DIGITS + 1 or len(str(a.denominator)) * abs(int(b)) > MAX_DIGITS + 1:
        raise CalcError(f"a value has more than {MAX_DIGITS} digits")
    if a == 0 and b < 0:
        raise CalcError("division by zero")
    return a ** int(b)


def _eval(node: ast.AST) -> Fraction:
    # exact rational arithmetic: 0.1 + 0.2 is 0.3, and 10 / 4 is 5/2 shown as 2.5
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if type(node.value) is float and not (node.value == node.value and abs(node.value) != float("inf")):
            raise CalcError("not a finite number")
        return _size_ok(Fraction(str(node.value)) if type(node.value) is float else Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _size_ok(_power(a, b))
        if b == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise CalcError("division by zero")
        return _size_ok(Fraction(_BINARY[type(node.op)](a, b)))
    raise CalcError(f"unsupported: {type(node).__name__} (numbers, + - * / // % ** and parentheses only)")


def _show(x: Fraction) -> str:
    if x.denominator == 1:
        return str(x.numerator)
    # a terminating decimal is shown exactly; any other fraction to 12 significant digits
    d = x.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    if d == 1:
        whole, rest = divmod(abs(x.numerator), x.denominator)
        digits, places = "", 0
        while rest:
            rest *= 10
            digits += str(rest // x.denominator)
            rest %= x.denominator
            places += 1
        return f"{'-' if x < 0 else ''}{whole}.{digits}"
    return f"{float(x):.12g}"


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression as text (`"23 * 47"` -> `"1081"`); CalcError if refused."""
    if not isinstance(expression, str):
        raise CalcError("the expression must be a string")
    text = expression.strip().replace("×", "*").replace("÷", "/")
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise CalcError(f"cannot parse {text!r}: {e.msg}") from None
    return _show(_eval(tree))


def server(log: Optional[str] = None):
    """The FastMCP server with the `calculate` tool; each call appended to `log` when given."""
    from fastmcp import Context, FastMCP
    from fastmcp.exceptions import ToolError

    mcp = FastMCP("calculator")
    lock = threading.Lock()

    @mcp.tool
    def calculate(expression: str, ctx: Context) -> str:
        """Evaluate an arithmetic expression, e.g. "23 * 47" or "(120 - 45) / 3"."""
        try:
            result = evaluate(expression)
        except CalcError as e:
            result = f"error: {e}"
        if log:
            meta = getattr(ctx.request_context, "meta", None) if ctx.request_context else None
            key = getattr(meta, "idempotency_key", None) or (meta.get("idempotency_key") if isinstance(meta, dict) else None)
            with lock, open(log, "a") as f:
                f.write(json.dumps({"expression": expression, "result": result, "idempotency_key": key}) + "\n")
        if result.startswith("error: "):
            raise ToolError(result[len("error: "):])
        return result

    return mcp


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m async_rl.env.calculator", description=__doc__.splitlines()[0])
    p.add_argument("--log", default=None, help="append one JSON line per call to this file")
    p.add_argument("--http", default=None, metavar="HOST:PORT", help="serve streamable HTTP instead of stdio")
    args = p.parse_args(argv)
    # as a stdio child its log lines land on the trainer's stderr, and each refused call is
    # already the policy's observation: quiet unless FASTMCP_LOG_LEVEL asks otherwise
    os.environ.setdefault("FASTMCP_LOG_LEVEL", "CRITICAL")
    mcp = server(args.log)
    if args.http:
        host, _, port = args.http.rpartition(":")
        mcp.run(transport="http", host=host or "127.0.0.1", port=int(port), show_banner=False)
    else:
        mcp.run(transport="stdio", show_banner=False)


if __name__ == "__main__":
    main()
