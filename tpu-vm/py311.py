"""Make vllm-torchtpu-core 0.29.0 (written for Python >= 3.12) importable on Python 3.11, in place.

Two files of the plugin use 3.12-only syntax (PEP 695); both forms are rewritten to their 3.11 spelling:
    type LayerKVCache = X                   ->  LayerKVCache = X
    def f[T: Bound](...)                    ->  T = typing.TypeVar("T", bound=Bound); def f(...)
Then every module of the package is compiled with this interpreter; any other 3.12-only syntax is
reported by file and line and the script fails (exit 1).

usage: python3 py311.py SITE_DIR      (SITE_DIR holds vllm_torchtpu/)
"""

from __future__ import annotations

import pathlib
import re
import sys

TYPE_ALIAS = re.compile(r"^type (\w+) = (.+)$", re.M)
GENERIC_DEF = re.compile(r"^def (\w+)\[(\w+): ([^\]]+)\]\(", re.M)


def rewrite(source: str) -> str:
    source = TYPE_ALIAS.sub(r"\1 = \2", source)

    def typevar(m: re.Match[str]) -> str:
        name, param, bound = m.groups()
        return f'{param} = __import__("typing").TypeVar("{param}", bound="{bound}")\n\n\ndef {name}('

    return GENERIC_DEF.sub(typevar, source)


def main(site: pathlib.Path) -> int:
    package = site / "vllm_torchtpu"
    if not package.is_dir():
        print(f"no vllm_torchtpu package under {site}", file=sys.stderr)
        return 1
    changed, errors = [], []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        new = rewrite(source)
        if new != source:
            path.write_text(new)
            changed.append(str(path.relative_to(site)))
        try:
            compile(new, str(path), "exec")
        except SyntaxError as e:
            errors.append(f"{path.relative_to(site)}:{e.lineno}: {e.msg}")
    print(f"py311: rewrote {len(changed)} file(s): {', '.join(changed) or '-'}")
    for error in errors:
        print(f"py311: still 3.12-only: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1])))
