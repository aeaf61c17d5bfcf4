"""tests/forkserver.py, which most tests' ranks and plain processes are forked from, against
torchrun itself and a fresh process."""

import json

import pytest

from conftest import launch, run_python

pytestmark = pytest.mark.main_only  # the test harness: no library version enters it

# one write per rank: two ranks share the pipe, and print's text and newline can be two writes
# (unbuffered output) that the other rank's line lands between
SHOW = ("import json, os, sys; os.write(1, ('ENV ' + json.dumps([{k: v for k, v in "
        "os.environ.items() if k.startswith(('RANK', 'LOCAL_', 'WORLD_', 'GROUP_', 'ROLE_', "
        "'MASTER_', 'TORCHELASTIC_'))}, sys.argv]) + '\\n').encode())")


def shown(out: str) -> list[tuple[dict, list]]:
    """(environment, argv) of each rank, by rank."""
    shown = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ENV ")]
    return sorted(((env, argv) for env, argv in shown), key=lambda x: x[0]["RANK"])


def test_ranks_see_what_torchrun_gives_its_ranks(tmp_path):
    """The same rank variables (names and values, but the port and the run id torchrun picks,
    and the two of its agent's own) and the same argv as under torchrun, for a script run as
    __main__."""
    script = tmp_path / "show.py"
    script.write_text(SHOW.replace("; os.write", "\nassert __name__ == '__main__'\nos.write"))
    forked = shown(launch([str(script), "a", "--b=1"]))
    real = shown(launch([str(script), "a", "--b=1"], torchrun=True))
    assert len(forked) == len(real) == 2
    for (fe, fa), (re_, ra) in zip(forked, real):
        assert fa == ra == [str(script), "a", "--b=1"]
        # what the forked ranks lack: the agent's store and error file (tests/forkserver.py)
        assert re_.keys() - fe.keys() == {"TORCHELASTIC_USE_AGENT_STORE",
                                          "TORCHELASTIC_ERROR_FILE"}, (fe, re_)
        differ = {k for k in fe if fe[k] != re_.get(k)}
        assert differ == {"MASTER_PORT", "TORCHELASTIC_RUN_ID"}, (differ, fe, re_)


def test_a_failed_rank_ends_the_others_and_nothing_leaks_into_the_next_job(tmp_path):
    """Rank 1 exits 3 while rank 0 would sleep for ten minutes: the job ends with 3 long before
    its limit. A job's environment and module state are not seen by the next job, and a plain
    process has no rank variables."""
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "import grpo\n"
                      "os.environ['LEAKED'] = '1'\n"
                      "grpo.LEAKED = 1\n"
                      "sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(600)\n")
    with pytest.raises(pytest.fail.Exception, match="exited 3"):
        launch([str(script)], timeout=120)
    proc = run_python(["-c", "import os, grpo; print(os.environ.get('LEAKED'), "
                       "hasattr(grpo, 'LEAKED'), os.environ.get('RANK'), __name__)"])
    assert proc.returncode == 0 and proc.stdout.split() == ["None", "False", "None", "__main__"]
