"""Every ```python block of README.md and docs/ runs: a documented example that stops working fails the suite.

Each block runs with `exec` in a fresh namespace, in a temporary working directory, offline (`HF_HUB_OFFLINE=1`, set
by conftest) and on one torch thread. An HTML comment on the line right before a block's fence changes that:

- `<!-- docs-test: skip reason="..." -->`: the block is not run, and the test is reported skipped with the reason
  (a GPU or the Hub needed, a call signature, a fragment whose names are the reader's). The reason is required.
- `<!-- docs-test: continue -->`: the block runs in the namespace the previous block of the same page left (a page
  that builds a model in one block and uses it in the next). The chain is one test, named after its first block.
- `<!-- docs-test: tiny-model -->`: the Hub ids of LLaDA and Dream checkpoints are replaced by local tiny checkpoints
  of the same architectures, `"cuda"` by `"cpu"` and `torch.bfloat16` by `torch.float32`, so a block written for the
  8B models on a GPU runs here as written otherwise. It combines with `continue` (`<!-- docs-test: continue
  tiny-model -->`). float32 because PyTorch's CPU kernels for bfloat16 attention are chosen by the CPU's features
  and fail under `ATEN_CPU_CAPABILITY=default` on a CPU with AMX ("pack_vnni2 is only supported when avx512 is
  supported"); the docs test checks the package's code, on every CPU.
- `<!-- docs-test: substitute="OLD=>NEW" -->` (repeatable): the test replaces the text OLD of the block by NEW, to run
  a long block (a benchmark's five timing rounds, say) at a size a test can afford; the block must contain OLD.

Blocks that train use tiny settings (a recipe with large ones is marked `skip`, and a runnable small block sits next
to it); the tiny models are built once per session.
"""

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKER = re.compile(r"<!--\s*docs-test:(?P<body>.*?)-->\s*$")
FENCE = re.compile(r"^```python[ \t]*\n(?P<code>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
KNOWN_OPTIONS = {"skip", "continue", "tiny-model"}
# Hub checkpoints the docs load, and the tiny architecture each is replaced by under `tiny-model`.
HUB_MODELS = {
    "GSAI-ML/LLaDA-8B-Instruct": "llada",
    "GSAI-ML/LLaDA-1.5": "llada",
    "Dream-org/Dream-v0-Instruct-7B": "dream",
}


@dataclass
class Block:
    page: Path
    line: int
    code: str
    options: set[str] = field(default_factory=set)
    reason: str | None = None
    substitutions: list[tuple[str, str]] = field(default_factory=list)

    @property
    def name(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"


def parse_marker(body: str, where: str) -> tuple[set[str], str | None, list[tuple[str, str]]]:
    """`(options, skip reason, substitutions)` of a marker's body."""
    words = shlex.split(body)
    options = {word for word in words if "=" not in word}
    settings = [word.split("=", 1) for word in words if "=" in word]
    unknown = (options - KNOWN_OPTIONS) | ({key for key, _ in settings} - {"reason", "substitute"})
    if unknown:
        raise ValueError(f"{where}: unknown docs-test marker option(s) {sorted(unknown)}; known: {KNOWN_OPTIONS}.")
    reason = next((value for key, value in settings if key == "reason"), None)
    if "skip" in options and not reason:
        raise ValueError(f'{where}: a skipped block needs a reason: <!-- docs-test: skip reason="..." -->.')
    substitutions = [tuple(value.split("=>", 1)) for key, value in settings if key == "substitute"]
    if any(len(pair) != 2 for pair in substitutions):
        raise ValueError(f'{where}: write a substitution as substitute="OLD=>NEW".')
    return options, reason, substitutions


def page_blocks(page: Path) -> list[Block]:
    text = page.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        previous = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(previous)
        block = Block(page, line, match.group("code"))
        if marker:
            block.options, block.reason, block.substitutions = parse_marker(marker.group("body"), block.name)
        blocks.append(block)
    return blocks


def chains() -> list[list[Block]]:
    """Each page's blocks, `continue` blocks joined to the chain before them."""
    result = []
    for page in PAGES:
        for block in page_blocks(page):
            if "continue" in block.options:
                if not result or result[-1][0].page != page:
                    raise ValueError(f"{block.name}: `continue` needs an earlier block on the same page.")
                result[-1].append(block)
            else:
                result.append([block])
    return result


CHAINS = chains()


@pytest.fixture(scope="session")
def tiny_hub_checkpoints(tmp_path_factory, tiny_llada_dir, tiny_dream, tiny_tokenizer):
    """Hub id -> a local tiny checkpoint of the same architecture."""
    from helpers import save_checkpoint

    dream_dir = save_checkpoint(tiny_dream, tiny_tokenizer, tmp_path_factory.mktemp("tiny-dream"))
    directories = {"llada": str(tiny_llada_dir), "dream": str(dream_dir)}
    return {hub_id: directories[kind] for hub_id, kind in HUB_MODELS.items()}


def test_every_python_block_is_collected():
    # The fence pattern must see every block a reader sees, or an example would silently escape the test.
    for page in PAGES:
        fences = sum(1 for line in page.read_text().splitlines() if line.startswith("```python"))
        assert len(page_blocks(page)) == fences, page


@pytest.mark.parametrize("chain", CHAINS, ids=[chain[0].name for chain in CHAINS])
def test_doc_block_runs(chain, tmp_path, monkeypatch, request):
    skipped = [block for block in chain if "skip" in block.options]
    if skipped:
        if len(skipped) != len(chain):
            raise ValueError(f"{skipped[0].name}: a skipped block cannot be part of a `continue` chain.")
        pytest.skip(skipped[0].reason)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", [chain[0].name])  # a block that reads sys.argv sees no pytest arguments
    namespace = {"__name__": "__docs_example__"}
    for block in chain:
        code = block.code
        for old, new in block.substitutions:
            assert old in code, f"{block.name}: the substitution's text {old!r} is not in the block"
            code = code.replace(old, new)
        if "tiny-model" in block.options:
            checkpoints = request.getfixturevalue("tiny_hub_checkpoints")
            for hub_id, directory in checkpoints.items():
                code = code.replace(f'"{hub_id}"', repr(directory))
            code = code.replace('"cuda"', '"cpu"').replace("torch.bfloat16", "torch.float32")
        exec(compile(code, block.name, "exec"), namespace)  # noqa: S102 - the documented example itself
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_markers_are_checked(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- docs-test: skip -->\n```python\nprint(1)\n```\n")
    with pytest.raises(ValueError, match="needs a reason"):
        page_blocks(page)
    page.write_text("<!-- docs-test: tiny-modle -->\n```python\nprint(1)\n```\n")
    with pytest.raises(ValueError, match="unknown docs-test marker"):
        page_blocks(page)
    page.write_text('text\n<!-- docs-test: continue substitute="1=>2" -->\n```python\nprint(1)\n```\n')
    (block,) = page_blocks(page)
    assert block.options == {"continue"} and block.substitutions == [("1", "2")] and block.code == "print(1)\n"


def rl_trainer_classes():
    from trl_diffusion import DiffusionRLTrainer
    from trl_diffusion.scripts.registry import TRAINING_COMMANDS, trainer_classes

    classes = [trainer_classes(name)[1] for name in TRAINING_COMMANDS]
    return [cls for cls in classes if issubclass(cls, DiffusionRLTrainer)]


@pytest.mark.parametrize("trainer_class", rl_trainer_classes(), ids=lambda cls: cls.__name__)
def test_trainer_docstring_sketch_builds_its_own_trainer(trainer_class):
    """The sketch `trainer_example` writes parses, and builds this trainer from its own config class."""
    import ast
    import inspect

    doc = inspect.getdoc(trainer_class)
    config_name = trainer_class.config_class.__name__
    assert f"with [`{config_name}`] as `args`." in doc
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    tree = ast.parse(code)
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert {config_name, trainer_class.__name__} <= imported
    calls = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert {config_name, trainer_class.__name__} <= calls
