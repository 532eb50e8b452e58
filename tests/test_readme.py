"""The README's two set-up commands are what CI runs, character for character (.ci/run runs each in its own fresh
venv); the demo answer CI checks is the one the README shows."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts) -> str:
    with open(os.path.join(REPO, *parts)) as f:
        return f.read()


def readme_setup_commands() -> list[str]:
    """The command lines of the README's first code block (comments dropped)."""
    block = re.search(r"```bash\n(.*?)```", _read("README.md"), re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_the_readme_commands_verbatim():
    commands = readme_setup_commands()
    assert len(commands) == 2, commands
    assert "-e . &&" in commands[0] and "pip install" in commands[0] and "dllm-jax generate" in commands[0]
    assert '".[test]"' in commands[1] and "pytest" in commands[1]
    ci_lines = _read(".ci", "run").splitlines()
    for command in commands:
        assert command in ci_lines, f".ci/run does not run the README's command verbatim:\n{command}"


def test_ci_checks_the_answer_the_readme_shows():
    prompt = re.search(r'dllm-jax generate "([^"]+)"', readme_setup_commands()[0]).group(1)
    ci = _read(".ci", "run")
    answer = re.search(r'^answer="([^"]+)"$', ci, re.M).group(1)
    shown = re.search(rf"^{re.escape(prompt)}\s+-> (.+)$", _read("README.md"), re.M).group(1)
    head, _, tail = shown.partition(" ... ")
    assert answer.startswith(head.rstrip()) and answer.endswith(tail.lstrip()), (answer, shown)
