"""docs/ARCHITECTURE.md section 3 ("Layout") against the tree: every path it names is a tracked file or folder
(unless the text calls it git-ignored), and its device-script and test lists name every file of their folders, so
the section cannot go stale silently. CPU only, no imports of blockdiff; reads `git ls-files` (the files on disk
where the checkout is not a git repository)."""
import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
EXTENSIONS = (".py", ".json", ".md", ".sh", ".ipynb", ".csv", ".png", ".txt", ".toml", ".cfg")
#: column where the Source listing's descriptions start
DESC_COL = 26


def _tracked() -> set[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        files = {f for f in out.decode().split("\0") if f}
    except (OSError, subprocess.SubprocessError):
        files = set()
    if not files:  # not a git checkout (an sdist, an exported tree): what is on disk
        files = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts}
    return files


TRACKED = _tracked()
FOLDERS = {"/".join(f.split("/")[:i]) for f in TRACKED for i in range(1, f.count("/") + 1)}


def _section() -> str:
    text = DOC.read_text()
    return text[text.index("## 3. Layout"):text.index("## 4. ")]


def _subsection(title: str) -> str:
    sec = _section()
    start = sec.index(f"### {title}\n")
    nxt = sec.find("\n### ", start + 1)
    return sec[start:nxt if nxt >= 0 else len(sec)]


def _exists(path: str) -> bool:
    path = path.rstrip("/")
    return path in TRACKED or path in FOLDERS


def _pattern(token: str) -> re.Pattern:
    """A doc token as a regex over tracked paths: ``<name>`` and ``*`` stand for one name part."""
    parts = re.split(r"(<\w+>|\*)", token.rstrip("/"))
    return re.compile("".join("[A-Za-z0-9_.-]+" if p in ("*",) or re.fullmatch(r"<\w+>", p) else re.escape(p)
                              for p in parts))


def _resolves(token: str) -> bool:
    """A path or file name from the text: exact, or the tail of a tracked path (a name given beside its folder)."""
    rx = _pattern(token)
    for cand in TRACKED | FOLDERS:
        if rx.fullmatch(cand) or any(rx.fullmatch("/".join(cand.split("/")[i:])) for i in range(1, cand.count("/") + 1)):
            return True
    return False


def source_listing() -> list[str]:
    """Full paths of every entry of the Source listing (folders end in "/"). An entry's names run up to two
    spaces or the description column; a name list ending in a comma continues on the next line."""
    block = _subsection("Source").split("```")[1]
    paths, stack, pending = [], [], None
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if pending is None and indent >= DESC_COL:
            continue  # a description's continuation
        names_part = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        if pending is not None:
            depth = pending
        else:
            depth = indent // 2
        names = [n.strip() for n in names_part.split(",") if n.strip()]
        pending = depth if names_part.rstrip().endswith(",") else None
        del stack[depth:]
        for name in names:
            full = "/".join(stack + [name.rstrip("/")]) + ("/" if name.endswith("/") else "")
            paths.append(full)
        if len(names) == 1 and names[0].endswith("/"):
            stack.append(names[0].rstrip("/"))
    return paths


def test_source_listing_parses_the_tree():
    paths = source_listing()
    for expected in ("attention/", "attention/triton/config.py", "attention/cute/kernel_roles.py",
                     "sampler/tp/step.py", "bench/bench_serve.py", "bench/sweep_cute_attention.py",
                     "bench/device_env.sh", "bench/experiments/device/", "bench/results/history/",
                     "notebooks/", "docs/"):
        assert expected in paths, expected


def test_every_source_listing_path_is_tracked():
    missing = [p for p in source_listing() if not _exists(p)]
    assert not missing, f"docs/ARCHITECTURE.md section 3 lists paths that are not in the tree: {missing}"


def test_every_path_named_in_the_section_resolves():
    """Backticked paths and file names anywhere in section 3 (the table, the prose, the test lists)."""
    sec = _section()
    bad = []
    for m in re.finditer(r"`([^`\s]+)`", sec):
        token = m.group(1)
        if not re.fullmatch(r"[\w.<>*/-]+", token) or not ("/" in token or token.endswith(EXTENSIONS)):
            continue
        if token.startswith("../") or "git-ignored" in sec[max(0, m.start() - 40):m.start()]:
            continue  # outside the repository, or said to be untracked
        if not _resolves(token):
            bad.append(token)
    assert not bad, f"docs/ARCHITECTURE.md section 3 names paths that are not in the tree: {bad}"


def _device_entry() -> str:
    block = _subsection("Source").split("```")[1]
    start = block.index("    device/")
    m = re.search(r"\(([^)]*)\)", block[start:])
    return " ".join(m.group(1).split())


def test_device_script_list_is_complete_and_current():
    listed = set(re.findall(r"[\w.-]+\.sh", _device_entry()))
    folder = "bench/experiments/device/"
    present = {f[len(folder):] for f in TRACKED if f.startswith(folder) and "/" not in f[len(folder):]}
    assert listed, "no scripts parsed from the device/ entry"
    assert not present - listed, f"device/ scripts missing from docs/ARCHITECTURE.md section 3: {sorted(present - listed)}"
    assert not listed - present, f"docs/ARCHITECTURE.md section 3 lists device/ scripts not in the tree: {sorted(listed - present)}"


def _test_names() -> tuple[set[str], set[str]]:
    """(folders whose files the Tests subsection lists one by one, tests/<path> names it mentions, patterns
    expanded). A bullet starting with a `tests/<folder>/...` path enumerates that folder."""
    text = _subsection("Tests")
    flat = " ".join(text.split())
    enumerated = {"tests"}
    for m in re.finditer(r"^- `(tests/[\w/]+)/[^`/]+`", text, re.M):
        enumerated.add(m.group(1))
    names = set(re.findall(r"`(?:tests/[\w/]*?)?([\w.-]+\.(?:py|json))`", flat))
    for m in re.finditer(r"`(?:tests/[\w/]+/)?(\w*)<\w+>(\.py)` \(([^)]*)\)", flat):
        for item in m.group(3).split(","):
            names.add(f"{m.group(1)}{item.strip()}{m.group(2)}")
    return enumerated, names


def test_tests_lists_name_every_file_of_their_folders():
    enumerated, names = _test_names()
    assert {"tests/attention/triton", "tests/attention/cute", "tests/sampler/triton", "tests/sampler/tp",
            "tests/bench"} <= enumerated
    missing = sorted(f for f in TRACKED if f.startswith("tests/") and f.rsplit("/", 1)[0] in enumerated
                     and f.rsplit("/", 1)[1] not in names)
    assert not missing, ("files missing from docs/ARCHITECTURE.md section 3 (Tests): " + ", ".join(missing))


def test_tests_pattern_lists_name_existing_files():
    """Each `test_<prefix><module>.py` (a, b, ...) expansion is a file of that folder."""
    flat = " ".join(_subsection("Tests").split())
    bad = []
    for m in re.finditer(r"`(tests/[\w/]+/)(\w*)<\w+>(\.py)` \(([^)]*)\)", flat):
        for item in m.group(4).split(","):
            path = f"{m.group(1)}{m.group(2)}{item.strip()}{m.group(3)}"
            if path not in TRACKED:
                bad.append(path)
    assert not bad, f"docs/ARCHITECTURE.md section 3 (Tests) names files not in the tree: {bad}"


def test_every_test_folder_is_named():
    """A folder of tests/ holding tests is named in the Tests subsection (as a path or as `sub/` of its parent)."""
    text = _subsection("Tests")
    flat = " ".join(text.split())
    folders = {f.rsplit("/", 1)[0] for f in TRACKED if f.startswith("tests/") and f.rsplit("/", 1)[1].startswith("test_")}
    unnamed = [d for d in sorted(folders) if d != "tests" and f"`{d}/" not in flat and f"`{d.rsplit('/', 1)[1]}/`" not in flat]
    assert not unnamed, f"test folders not named in docs/ARCHITECTURE.md section 3 (Tests): {unnamed}"



def test_every_helper_module_of_tests_is_named():
    """A tracked .py under tests/ that is not a test file (helpers, conftest.py, scripts) is named in the Tests
    subsection, by its path or, for conftest.py, by its name."""
    flat = " ".join(_subsection("Tests").split())
    helpers = sorted(f for f in TRACKED if f.startswith("tests/") and f.endswith(".py")
                     and not f.rsplit("/", 1)[1].startswith("test_"))
    unnamed = [f for f in helpers if f"`{f}`" not in flat and f"`{f.rsplit('/', 1)[1]}`" not in flat]
    assert not unnamed, f"helper modules of tests/ not named in docs/ARCHITECTURE.md section 3 (Tests): {unnamed}"

@pytest.mark.parametrize("token,ok", [("attention/triton/config.py", True), ("triton_sweep-h200.json", True),
                                      ("tests/attention/triton/test_triton_<module>.py", True),
                                      ("attention/no_such_module.py", False)])
def test_resolver(token, ok):
    assert _resolves(token) is ok


#: The backend folders whose module order the Source listing states ("Inside a backend folder, each module imports
#: only modules listed above it here"; section 2, rule 3: helpers at the bottom, the host interface on top).
BACKEND_FOLDERS = ("attention/triton/", "attention/cute/", "sampler/triton/", "sampler/tp/")


def _sibling_imports(path: Path) -> set[str]:
    """Modules of ``path``'s own folder that it imports (``from .x import``, ``from . import x``), function-local
    imports included."""
    siblings = {p.stem for p in path.parent.glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
            found.update(n for n in names if n in siblings)
    return found


@pytest.mark.parametrize("folder", BACKEND_FOLDERS)
def test_backend_folder_modules_import_only_modules_listed_above_them(folder):
    listed = [p[len(folder):-3] for p in source_listing()
              if p.startswith(folder) and p.endswith(".py") and "/" not in p[len(folder):]]
    assert listed, f"no modules of {folder} parsed from the Source listing"
    bad = []
    for i, mod in enumerate(listed):
        below = _sibling_imports(ROOT / folder / f"{mod}.py") - set(listed[:i]) - {mod}
        bad += [f"{folder}{mod}.py imports {folder}{b}.py" for b in sorted(below) if b in listed]
    assert not bad, ("docs/ARCHITECTURE.md section 3 (Source) says a backend folder's modules import only modules "
                     "listed above them; reorder the listing: " + "; ".join(bad))
