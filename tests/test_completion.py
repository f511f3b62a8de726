"""`mxc completion`: scripts from the parser that every shell accepts, with zoo model names."""

import shutil
import subprocess

import pytest

from mxc.compiler import cli
from mxc.spec import zoo_names


def completion_script(capsys, shell: str) -> str:
    assert cli.main(["completion", shell]) == 0
    return capsys.readouterr().out


def subcommands() -> list[str]:
    parser = cli.build_parser()
    return list(parser._subparsers._group_actions[0].choices)


def test_bash_script_is_valid_and_lists_every_subcommand(capsys, tmp_path):
    script = tmp_path / "mxc.bash"
    script.write_text(completion_script(capsys, "bash"))
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    # What bash offers after `mxc <TAB>`: every subcommand --help lists.
    offered = complete_in_bash(script, ["mxc", ""])
    assert set(subcommands()) <= set(offered) and "completion" in offered


def test_bash_completes_zoo_models_where_a_model_is_expected(capsys, tmp_path):
    script = tmp_path / "mxc.bash"
    script.write_text(completion_script(capsys, "bash"))
    assert "llama3-tiny" in zoo_names()
    for command in ("plan", "compile", "check", "show", "forward", "export-hf"):
        assert complete_in_bash(script, ["mxc", command, "llama3-t"]) == ["llama3-tiny"], command


def complete_in_bash(script, words: list[str]) -> list[str]:
    line = " ".join(words)
    driver = (f"source {script}\nCOMP_WORDS=({' '.join(repr(w) for w in words)}); "
              f"COMP_CWORD={len(words) - 1}; COMP_LINE={line!r}; COMP_POINT={len(line)}\n"
              "_shtab_mxc\nprintf '%s\\n' \"${COMPREPLY[@]}\"\n")
    done = subprocess.run(["bash", "-c", driver], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [w for w in done.stdout.splitlines() if w]


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_zsh_and_fish_scripts_name_every_subcommand_and_the_zoo(capsys, shell):
    script = completion_script(capsys, shell)
    for name in subcommands():
        assert name in script
    assert "llama3-tiny" in script
    if shutil.which(shell):  # the shell's own parser where it is installed
        assert subprocess.run([shell, "-n", "-c", script] if shell == "zsh" else
                              [shell, "--no-execute", "-c", script]).returncode == 0


def test_unknown_shell_is_a_usage_error(capsys):
    assert cli.main(["completion", "tcsh"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_fish_completes_zoo_models(capsys, tmp_path):
    script = tmp_path / "mxc.fish"
    script.write_text(completion_script(capsys, "fish"))
    fish = shutil.which("fish")
    if fish is None:  # without fish, the script's text is checked above
        return
    done = subprocess.run([fish, "-c", f"source {script}; complete -C 'mxc plan llama3-t'"],
                          capture_output=True, text=True)
    assert [line.split("\t")[0] for line in done.stdout.splitlines()] == ["llama3-tiny"], done.stderr
