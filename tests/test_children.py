"""Child programs live in tests/children/ as modules, never as Python code in a string: a test
that runs `python -c CODE` fails here, naming the file and line, so such code does not come back
unlinted and unformatted."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).parent
CHILDREN = TESTS / "children"
# The program a command runs, spelled as the tests spell a Python interpreter.
PYTHON_PROGRAM = re.compile(r"python|sys\.executable", re.IGNORECASE)


def python_code_in_strings(source: str) -> list[int]:
    """Lines where a command list, or a call's arguments, run a Python interpreter with `-c`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.List, ast.Tuple)):
            command = node.elts
        elif isinstance(node, ast.Call):
            command = node.args
        else:
            continue
        flags = [i for i, e in enumerate(command) if isinstance(e, ast.Constant) and e.value == "-c"]
        if flags and PYTHON_PROGRAM.search(ast.unparse(command[0])):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_check_finds_python_code_in_a_string_and_lets_shells_be():
    found = python_code_in_strings('import subprocess, sys\n'
                                   'subprocess.run([sys.executable, "-c", "print(1)"])\n'
                                   'subprocess.run([PYTHON, "-c", CODE, "x"])\n'
                                   'run(python, "-c", "import sysconfig")\n'
                                   'subprocess.run(["bash", "-c", "echo"])\n'
                                   'subprocess.run([shell, "-n", "-c", script])\n'
                                   'subprocess.run([sys.executable, "-m", "tests.children.x"])\n')
    assert found == [2, 3, 4]


def test_no_test_runs_python_code_from_a_string():
    offenders = [f"{path.relative_to(TESTS)}:{line}" for path in sorted(TESTS.rglob("*.py"))
                 for line in python_code_in_strings(path.read_text())]
    assert offenders == [], ("a child process runs Python code from a string; put the program in "
                             f"tests/children/ as a module with main() instead: {offenders}")


def test_every_child_program_is_a_module_with_a_main():
    programs = [p for p in sorted(CHILDREN.glob("*.py")) if p.name != "__init__.py"]
    assert programs
    for program in programs:
        tree = ast.parse(program.read_text())
        assert ast.get_docstring(tree), f"{program.name} says what it does and how it is run"
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert "main" in names, f"{program.name} has no main()"
        assert "__main__" in program.read_text(), f"{program.name} does not run main() as a script"
