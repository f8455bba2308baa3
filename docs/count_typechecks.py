"""Count the ra_lens signatures that jaxtyping + beartype check in the test run.

Installs the same import hook as pytest's --jaxtyping-packages, imports every ra_lens module, and
for each function/method/dataclass __init__ defined in ra_lens reports whether the hook wrapped it
and which parameters/returns carry a jaxtyping array type (checked unless inside Validated[...]).
Run from the repository root: .venv/bin/python docs/count_typechecks.py (and .venv-tl2/bin/python).
"""

import importlib
import inspect
import pkgutil
import sys
import typing

import jaxtyping

CHECKER = "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))"
jaxtyping.install_import_hook(["ra_lens"], CHECKER)
import ra_lens  # noqa: E402

mods = [ra_lens] + [
    importlib.import_module(m.name) for m in pkgutil.walk_packages(ra_lens.__path__, "ra_lens.")
]


def has_array(hint) -> bool:
    if isinstance(hint, type) and issubclass(hint, jaxtyping.AbstractArray):
        return True
    return any(has_array(a) for a in typing.get_args(hint))


def validated(hint) -> bool:  # Union[..., Any]: beartype lets anything through
    return typing.get_origin(hint) is typing.Union and typing.Any in typing.get_args(hint)


def wrapped(fn) -> bool:
    return getattr(fn, "__wrapped__", None) is not None or "jaxtyp" in repr(
        getattr(fn, "__code__", "")
    )


callables = []
for mod in mods:
    for name, obj in vars(mod).items():
        if getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isfunction(obj):
            callables.append((f"{mod.__name__}.{name}", obj, mod))
        elif inspect.isclass(obj):
            for mname, m in vars(obj).items():
                f = m.__func__ if isinstance(m, (classmethod, staticmethod)) else m
                f = f.fget if isinstance(f, property) else f
                if inspect.isfunction(f) and (
                    mname == "__init__" or not mname.startswith("__") or mname == "__call__"
                ):
                    callables.append((f"{mod.__name__}.{name}.{mname}", f, mod))

n_wrapped = n_funcs_arr = n_args_arr = n_validated_arr = n_args_all = 0
unwrapped = []
for qual, fn, mod in callables:
    inner = inspect.unwrap(fn)
    ok = wrapped(fn)
    n_wrapped += ok
    if not ok:
        unwrapped.append(qual)
    try:
        hints = typing.get_type_hints(inner, globalns=vars(mod), include_extras=True)
    except Exception:  # TYPE_CHECKING-only names: evaluate one at a time
        hints = {}
        for k, v in getattr(inner, "__annotations__", {}).items():
            try:
                hints[k] = eval(v, vars(mod)) if isinstance(v, str) else v
            except Exception:
                pass
    n_args_all += len(hints)
    arr = [k for k, h in hints.items() if has_array(h) and not validated(h)]
    val = [k for k, h in hints.items() if has_array(h) and validated(h)]
    globals().setdefault("n_val_all", [0])[0] += sum(validated(h) for h in hints.values())
    if arr and ok:
        n_funcs_arr += 1
        n_args_arr += len(arr)
    n_validated_arr += len(val)
    if "-v" in sys.argv and (arr or val):
        print(f"{qual}: checked {arr} validated {val} wrapped={ok}")

print(f"modules imported under the hook: {len(mods)}")
print(
    f"functions/methods/dataclass inits defined in ra_lens: {len(callables)}; wrapped: {n_wrapped}"
)
print(f"annotations (params + returns) on them: {n_args_all}")
print(
    f"with a checked jaxtyping array annotation: {n_funcs_arr} functions, {n_args_arr} params/returns"
)
print(
    f"jaxtyping annotations inside Validated[...] (documented, left to the function's check): {n_validated_arr}"
)
if unwrapped:
    print("not wrapped:", unwrapped[:20], len(unwrapped))
print(f"all parameters annotated Validated[...]: {n_val_all[0]}")
