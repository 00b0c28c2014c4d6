"""Running a class: release -> collect (a deadline, a late resubmission) -> grade with feedback -> return;
the gradebook CSVs; sharded grading equal to one run; the hub's config; the nbgrader export.

Grading is the real ``python -m llmsys grade`` in a subprocess, in its sandbox
where this machine can make one (else ``--unsafe``, as these are the course's
own notebooks).
"""

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
from datetime import datetime, timezone
from pathlib import Path

import pytest

from llmsys.course import grading, labs
from llmsys.course.classroom import exchange, feedback, gradebook, hub, nbgrader_export, roster

ROOT = Path(__file__).resolve().parents[1]
LAB = "lab00_warmup"
SOLUTION = ROOT / "solutions" / f"{LAB}.ipynb"
CORRECT = ROOT / "tests" / "fixtures" / "submissions" / f"correct_{LAB}.ipynb"
STUB = ROOT / "labs" / f"{LAB}.ipynb"
SEED = 1234
UNSAFE = ["--unsafe"] if grading.unavailable_reason() else []
ROSTER = """username,name,email,section,lms_id,sis_id,role
alice,Alice Liddell,alice@uni.edu,A,1001,S1001,student
bob,Bob Marley,bob@uni.edu,B,1002,S1002,student
carol,Carol Danvers,carol@uni.edu,A,1003,,student
dave,Dave Bowman,dave@uni.edu,B,,S1004,student
erin,Erin Brockovich,erin@uni.edu,A,1005,S1005,student
prof,Ada Lovelace,,,,,instructor
"""


def llmsys(*args, check=True):
    result = subprocess.run([sys.executable, "-m", "llmsys", *map(str, args)], capture_output=True, text=True,
                            cwd=ROOT, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if check and result.returncode not in (0, 1):
        raise AssertionError(f"llmsys {' '.join(map(str, args))} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def submit(folder: Path, source: Path) -> None:
    """What a student does: save a copy of their notebook into submit/."""
    target = folder / "submit" / f"{LAB}.ipynb"
    temporary = target.with_suffix(".saving")
    shutil.copyfile(source, temporary)
    temporary.replace(target)  # as Jupyter saves: a new file, a new change time


@pytest.fixture(scope="module")
def classroom(tmp_path_factory):
    """A class of five through release, collect (with a late resubmission), grade, return."""
    root = tmp_path_factory.mktemp("class")
    (root / "roster.csv").write_text(ROSTER, encoding="utf-8")
    ex = root / "exchange"
    out = llmsys("labs", "release", "--to", ex, "--users", root / "roster.csv", "--lab", LAB)
    assert out.returncode == 0, out.stderr
    submit(ex / "alice", CORRECT)
    submit(ex / "bob", ex / "bob" / f"{LAB}.ipynb")  # the untouched stub
    submit(ex / "carol", ex / "carol" / f"{LAB}.ipynb")  # first the stub, on time...
    (ex / "erin" / "submit" / f"{LAB}.ipynb").symlink_to(ex / "alice" / "submit" / f"{LAB}.ipynb")  # ...a copy by link
    first = llmsys("labs", "collect", "--from", ex, "--to", root / "collected", "--lab", LAB)
    deadline = datetime.now(timezone.utc)
    time.sleep(0.05)
    submit(ex / "carol", CORRECT)  # ...then the right answer, after the deadline
    os.utime(ex / "carol" / "submit" / f"{LAB}.ipynb", (0, 0))  # a back-dated modification time changes nothing
    second = llmsys("labs", "collect", "--from", ex, "--to", root / "collected", "--lab", LAB,
                    "--deadline", deadline.isoformat())
    submitted = root / "collected" / LAB / "submitted"
    graded = llmsys("grade", submitted, "--seed", SEED, "--json", root / "grades.json", "--csv", root / "grades.csv",
                    "--feedback", root / "feedback", *UNSAFE)
    returned = llmsys("labs", "return", "--from", root / "feedback", "--to", ex)
    return types.SimpleNamespace(root=root, exchange=ex, collected=root / "collected" / LAB, first=first,
                                 second=second, graded=graded, returned=returned, submitted=submitted)


def test_release_gives_each_student_a_copy_and_never_overwrites_their_work(classroom):
    ex = classroom.exchange
    assert sorted(p.name for p in ex.iterdir()) == ["alice", "bob", "carol", "dave", "erin"]  # no instructor folder
    assert (ex / "dave" / f"{LAB}.ipynb").read_text(encoding="utf-8") == labs.expected_labs(ROOT / "solutions")[f"{LAB}.ipynb"]
    (ex / "dave" / f"{LAB}.ipynb").write_text("my work", encoding="utf-8")
    again = llmsys("labs", "release", "--to", ex, "--users", classroom.root / "roster.csv", "--lab", LAB)
    assert "dave: lab00_warmup.ipynb kept" in again.stdout
    assert (ex / "dave" / f"{LAB}.ipynb").read_text(encoding="utf-8") == "my work"


def test_collect_flags_late_work_and_keeps_every_version(classroom):
    ledger = json.loads((classroom.collected / "collected.json").read_text(encoding="utf-8"))
    rows = {row["username"]: row for row in exchange.collected_rows(ledger)}
    assert {name: row["status"] for name, row in rows.items()} == {
        "alice": "on time", "bob": "on time", "carol": "late", "dave": "missing", "erin": "problem"}
    carol = ledger["students"]["carol"]["versions"]
    assert [v["late"] for v in carol] == [False, True] and carol[1]["late_by"]
    assert carol[1]["submitted_at"] > ledger["deadline"] > carol[0]["submitted_at"]  # ISO UTC strings sort as times
    assert len(list((classroom.collected / "history" / "carol").iterdir())) == 2
    assert (classroom.collected / "submitted" / "carol" / f"{LAB}.ipynb").read_bytes() == CORRECT.read_bytes()
    assert "a link" in rows["erin"]["problem"] and not (classroom.submitted / "erin").exists()
    assert classroom.second.returncode == 1 and "erin" in classroom.second.stdout and "late" in classroom.second.stdout


def test_collect_again_changes_nothing_and_a_later_deadline_reflags(classroom, tmp_path):
    shutil.copytree(classroom.collected, tmp_path / LAB)
    before = json.loads((tmp_path / LAB / "collected.json").read_text(encoding="utf-8"))
    ledger = exchange.collect(classroom.exchange, tmp_path, LAB, deadline=datetime(2100, 1, 1, tzinfo=timezone.utc))
    assert [len(s["versions"]) for s in ledger["students"].values()] == \
        [len(s["versions"]) for s in before["students"].values()]
    assert not any(v["late"] for s in ledger["students"].values() for v in s["versions"])


def test_grade_writes_feedback_that_return_puts_in_each_folder(classroom):
    assert classroom.graded.returncode == 0, classroom.graded.stdout + classroom.graded.stderr
    reports = {r["student"]: r for r in json.loads((classroom.root / "grades.json").read_text())["submissions"]}
    assert set(reports) == {"alice", "bob", "carol"}
    assert reports["alice"]["score"] == reports["alice"]["max_score"] == reports["carol"]["score"] > 0
    assert reports["bob"]["score"] == 0 and all(r["salt"] == SEED for r in reports.values())
    for student, report in reports.items():
        page = (classroom.exchange / student / "feedback" / f"{LAB}.html").read_text(encoding="utf-8")
        assert f"{report['score']} / {report['max_score']} points" in page
        for check in report["checks"]:
            assert check["id"] in page and f"{check['score'] if check['status'] != 'skipped' else '–'} / {check['points']}" in page
    bob = (classroom.exchange / "bob" / "feedback" / f"{LAB}.html").read_text(encoding="utf-8")
    assert "NotImplementedError" in bob and "failed" in bob
    assert "dave" not in classroom.returned.stdout and classroom.returned.returncode == 0


def test_return_never_follows_a_students_link(tmp_path):
    (tmp_path / "feedback" / "alice").mkdir(parents=True)
    (tmp_path / "feedback" / "alice" / f"{LAB}.html").write_text("<p>3 / 7</p>")
    (tmp_path / "ex" / "alice").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "ex" / "alice" / "feedback").symlink_to(tmp_path / "elsewhere")
    lines = exchange.return_feedback(tmp_path / "feedback", tmp_path / "ex")
    assert "not returned" in lines[0] and "link" in lines[0] and not list((tmp_path / "elsewhere").iterdir())


def test_feedback_escapes_what_a_submission_printed():
    report = grading.GradeReport("x.ipynb", "mallory", LAB, checks=[
        grading.CheckResult("c1", 2, 0, "failed", "<script>alert(1)</script>"),
        grading.CheckResult("w1", 3, 0, "pending", "to be scored", written=True, answer="<img src=x onerror=y>")])
    page = feedback.feedback_html(report.to_dict())
    assert "<script>" not in page and "&lt;script&gt;" in page and "<img" not in page
    assert "await the instructor" in page


# ---------------------------------------------------------------- gradebook


@pytest.fixture
def class_list(tmp_path):
    (tmp_path / "roster.csv").write_text(ROSTER, encoding="utf-8")
    return roster.read_roster(tmp_path / "roster.csv")


def report(student, score_of_each, written=None):
    checks = [grading.CheckResult(f"c{i}", 2, score, "passed" if score else "failed") for i, score in enumerate(score_of_each)]
    if written == "pending":
        checks.append(grading.CheckResult("why", 3, 0, "pending", written=True))
    elif written is not None:
        checks.append(grading.CheckResult("why", 3, written, "scored", written=True))
    return grading.GradeReport(f"{student}/{LAB}.ipynb", student, LAB, checks=checks, salt=7).to_dict()


def test_canvas_and_moodle_and_generic_columns(class_list):
    reports = [report("alice", [2, 2], written=3), report("bob", [0, 2], written=1), report("carol", [2, 0])]
    with pytest.raises(gradebook.GradebookError, match="neither for zed"):
        gradebook.gradebook_rows("canvas", reports, class_list + [roster.Person("zed")])
    header, rows = gradebook.gradebook_rows("canvas", reports, class_list, assignment="Lab 0")
    assert header == ["Student", "ID", "SIS User ID", "Section", "Lab 0"]
    assert rows[0] == ["Alice Liddell", "1001", "S1001", "A", 7] and rows[1][-1] == 3 and rows[2][-1] == 2
    assert rows[3] == ["Dave Bowman", "", "S1004", "B", ""]  # no submission: no grade, not a zero
    assert [r[0] for r in rows] == ["Alice Liddell", "Bob Marley", "Carol Danvers", "Dave Bowman", "Erin Brockovich"]
    header, rows = gradebook.gradebook_rows("moodle", reports, class_list, moodle_identifier="email")
    assert header == ["Email address", LAB] and rows[0] == ["alice@uni.edu", 7] and rows[4] == ["erin@uni.edu", ""]
    header, rows = gradebook.gradebook_rows("generic", reports, class_list)
    assert header[:2] == ["username", "name"] and rows[0][header.index("score")] == 7
    assert rows[0][header.index("max_score")] == 7 and rows[3][header.index("status")] == "missing"


@pytest.mark.parametrize("reports, says", [
    ([report("alice", [2], written="pending")], "alice's written answer(s) why are still pending"),
    ([report("mallory", [2])], "not students in the class list: mallory"),
    ([report("alice", [2]), report("alice", [0])], "two graded submissions"),
    ([], "choose one with --lab"),
])
def test_gradebook_refuses_what_is_not_a_grade(class_list, reports, says):
    with pytest.raises(gradebook.GradebookError) as error:
        gradebook.gradebook_rows("generic", reports, class_list)
    assert says in str(error.value)


def test_gradebook_command_writes_the_csv_of_a_real_grading(classroom, tmp_path):
    out = llmsys("classroom", "gradebook", classroom.root / "grades.json", "--users", classroom.root / "roster.csv",
                 "--format", "generic", "--collected", classroom.collected / "collected.json", "--out", tmp_path / "g.csv")
    assert out.returncode == 0, out.stderr
    with open(tmp_path / "g.csv", newline="", encoding="utf-8") as f:
        rows = {row["username"]: row for row in csv.DictReader(f)}
    assert rows["carol"]["status"] == "late" and rows["carol"]["versions"] == "2" and rows["carol"]["late_by"]
    assert rows["alice"]["status"] == "on time" and rows["dave"]["status"] == "missing" and rows["dave"]["score"] == ""


@pytest.mark.parametrize("text, says", [
    ("name\nalice\n", "'username' column"),
    ("username\n../bob\n", "not a login name"),
    ("username\nalice\nalice\n", "listed twice"),
    ("username,role\nalice,ta\n", "role 'ta'"),
    ("username,shoe_size\nalice,9\n", "unknown column"),
])
def test_a_bad_class_list_says_which_line(tmp_path, text, says):
    (tmp_path / "r.csv").write_text(text, encoding="utf-8")
    with pytest.raises(roster.RosterError, match=says.replace("(", r"\(").replace(".", r"\.")):
        roster.read_roster(tmp_path / "r.csv")


@pytest.mark.parametrize("argv, says", [
    (["labs", "release", "--to", "EX"], "--to EXCHANGE needs --users FILE"),
    (["labs", "collect", "--from", "EX", "--to", "OUT", "--lab", LAB, "--deadline", "friday"], "not an ISO 8601 time"),
    (["labs", "collect", "--from", "EX", "--to", "OUT", "--lab", LAB], "no exchange folder at EX"),
    (["labs", "return", "--from", "FB", "--to", "EX"], "no feedback folder at FB"),
    (["classroom", "hub", "--users", "ROSTER", "--out", "HUB", "--mig", "0,1"], "MIG device UUIDs"),
    (["classroom", "hub", "--users", "ROSTER", "--out", "HUB", "--memory", "lots"], "--memory takes a size"),
    (["labs", "collect", "--from", "EX", "--to", "OUT", "--lab", LAB, "--deadline", "2026-12-01T17:00"],
     "no UTC offset; add one, e.g. 2026-12-01T17:00+01:00"),
    (["labs", "collect", "--from", "EX", "--to", "OUT", "--lab", "lab99"], "no lab lab99; labs are"),
    (["classroom", "hub", "--users", "ROSTER", "--out", "HUB", "--port", "0"], "--port must be 1..65535"),
    (["classroom", "hub", "--users", "ROSTER", "--out", "HUB", "--port", "70000"], "--port must be 1..65535"),
    (["classroom", "hub", "--users", "ROSTER", "--out", "HUB", "--ip", "my-laptop"], "--ip takes an IP address"),
    (["classroom", "hub", "--users", "ROSTER", "--out", "ROSTER/hub"], "cannot write --out ROSTER/hub"),
    (["classroom", "gradebook", "ROSTER", "--users", "ROSTER", "--format", "moodle", "--out", "g.csv"],
     "not a grades file written by `grade --json`"),
])
def test_classroom_commands_refuse_bad_input_in_one_line(tmp_path, monkeypatch, capsys, argv, says):
    from llmsys.__main__ import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ROSTER").write_text(ROSTER, encoding="utf-8")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


# ------------------------------------------------------------------ shards


def test_shards_graded_apart_and_merged_equal_one_run(classroom, tmp_path):
    shard_jsons = []
    processes = []
    for k in range(2):
        shard_jsons.append(tmp_path / f"shard_{k}.json")
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "llmsys", "grade", classroom.submitted, "--seed", str(SEED), "--shard", f"{k}/2",
             "--json", shard_jsons[-1], *UNSAFE], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1"}))
    assert [p.wait(timeout=600) for p in processes] == [0, 0]
    sizes = [len(json.loads(p.read_text())["submissions"]) for p in shard_jsons]
    assert sorted(sizes) == [1, 2]  # three students, two shards: a partition
    merged = llmsys("grade", "merge", *reversed(shard_jsons), "--json", tmp_path / "merged.json",
                    "--csv", tmp_path / "merged.csv")
    assert merged.returncode == 0, merged.stderr

    def without_times(path):
        data = json.loads(Path(path).read_text())
        for r in data["submissions"]:
            r.pop("seconds")
        return data
    assert without_times(tmp_path / "merged.json") == without_times(classroom.root / "grades.json")
    assert (tmp_path / "merged.csv").read_text() == (classroom.root / "grades.csv").read_text()
    alone = llmsys("grade", "merge", shard_jsons[0], check=False)  # a shard missing is an error, not a small class
    assert alone.returncode == 2 and "shard(s) 1/2 missing" in alone.stdout


def test_shard_options_are_checked(capsys):
    assert grading.main([str(CORRECT), "--shard", "2/2", "--seed", "1", "--json", "x.json"]) == 2
    assert grading.main([str(CORRECT), "--shard", "0/2", "--json", "x.json"]) == 2
    out = capsys.readouterr().out
    assert "0 <= K < N" in out and "--shard needs --seed" in out


# --------------------------------------------------------------------- hub


def test_hub_deals_gpus_round_robin_and_splits_their_memory(tmp_path, class_list):
    plan = hub.plan_hub(class_list, ["0", "1"], tmp_path / "ex", sys.prefix, margin=0.9)
    env = {user: entry["environment"] for user, entry in plan["users"].items()}
    assert [env[u]["CUDA_VISIBLE_DEVICES"] for u in ["alice", "bob", "carol", "dave", "erin"]] == ["0", "1", "0", "1", "0"]
    assert float(env["alice"]["LLMSYS_GPU_MEMORY_FRACTION"]) == pytest.approx(0.9 / 3, abs=1e-4)  # 3 on GPU 0
    assert float(env["bob"]["LLMSYS_GPU_MEMORY_FRACTION"]) == pytest.approx(0.9 / 2, abs=1e-4)
    assert "prof" not in plan["users"] and plan["admins"] == ["prof"]
    mig = hub.devices_from(None, "MIG-4b1c2d3e-aaaa-bbbb-cccc-1234567890ab,MIG-5b1c2d3e-aaaa-bbbb-cccc-1234567890ab")
    plan = hub.plan_hub(class_list, mig, tmp_path / "ex", sys.prefix)
    assert plan["users"]["bob"]["environment"]["CUDA_VISIBLE_DEVICES"] == mig[1]
    plan = hub.plan_hub(class_list, [], tmp_path / "ex", sys.prefix)
    assert all(e["environment"]["CUDA_VISIBLE_DEVICES"] == "" for e in plan["users"].values())
    with pytest.raises(hub.HubError, match="MIG device UUIDs"):
        hub.devices_from(None, "0,1")
    with pytest.raises(hub.HubError, match="--memory"):
        hub.plan_hub(class_list, [], tmp_path, sys.prefix, memory="lots")


def test_the_written_config_gives_each_spawner_what_the_plan_promised(tmp_path):
    (tmp_path / "roster.csv").write_text(ROSTER, encoding="utf-8")
    out = llmsys("classroom", "hub", "--users", tmp_path / "roster.csv", "--gpus", "2", "--out", tmp_path / "hub",
                 "--exchange", tmp_path / "ex", "--spawner", "local", "--auth", "shared-password")
    assert out.returncode == 0, out.stderr
    from traitlets.config import Config

    config = Config()
    os.environ["LLMSYS_HUB_PASSWORD"] = "correct horse battery"
    exec((tmp_path / "hub" / "jupyterhub_config.py").read_text(), {"get_config": lambda: config,
                                                                   "__file__": str(tmp_path / "hub" / "jupyterhub_config.py")})
    plan = json.loads((tmp_path / "hub" / "classroom.json").read_text())
    assert config.Authenticator.allowed_users == {"alice", "bob", "carol", "dave", "erin"}
    assert config.Spawner.notebook_dir == str(tmp_path / "ex" / "{username}")
    assert any("cull_idle_timeout=3600" in a for a in config.Spawner.args)
    for username in plan["users"]:
        spawner = types.SimpleNamespace(user=types.SimpleNamespace(name=username), environment={})
        config.Spawner.pre_spawn_hook(spawner)
        assert spawner.environment["CUDA_VISIBLE_DEVICES"] == plan["users"][username]["environment"]["CUDA_VISIBLE_DEVICES"]
        assert spawner.environment["PYTHONPATH"] == str(tmp_path / "hub" / "site")
    assert "--array=0-3" in (tmp_path / "hub" / "grade_array.sbatch").read_text()


def test_the_gpu_share_hook_caps_torch_right_after_import(tmp_path):
    """With a stand-in torch module that records the call (no GPU here): the hook calls it once per device."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "calls = []\nclass cuda:\n    is_available = staticmethod(lambda: True)\n    device_count = staticmethod(lambda: 2)\n"
        "    set_per_process_memory_fraction = staticmethod(lambda f, d: calls.append((f, d)))\n")
    site = tmp_path / "site"
    site.mkdir()
    shutil.copyfile(Path(hub.__file__).with_name("gpu_share.py"), site / "sitecustomize.py")
    run = lambda fraction: subprocess.run(  # noqa: E731
        [sys.executable, "-c", "import torch; print(torch.calls)"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": f"{site}:{tmp_path / 'fake'}", "LLMSYS_GPU_MEMORY_FRACTION": fraction})
    assert run("0.25").stdout.strip() == "[(0.25, 0), (0.25, 1)]"
    assert run("").stdout.strip() == "[]"


# ----------------------------------------------------------------- nbgrader


def test_nbgrader_export_marks_every_cell_role():
    nb = nbgrader_export.to_nbgrader(labs.read_notebook(SOLUTION))
    roles = {c.metadata["nbgrader"].get("grade_id"): c.metadata["nbgrader"] for c in nb.cells if "nbgrader" in c.metadata}
    checks = {c.id: c for c in labs.graded_checks(labs.read_notebook(SOLUTION))}
    for check_id, check in checks.items():
        if check.gpu:
            assert check_id not in roles
        else:
            assert roles[check_id]["grade"] and roles[check_id]["points"] == check.points and roles[check_id]["locked"]
    assert any(r["solution"] and not r["grade"] for r in roles.values())


nbgrader_cli = shutil.which("nbgrader", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(nbgrader_cli is None, reason="nbgrader is not installed (pip install -e '.[test]')")
def test_nbgrader_autogrades_the_export_full_on_the_solution_and_zero_on_the_stub(tmp_path, monkeypatch):
    course = tmp_path / "course"
    nbgrader_export.export_lab(SOLUTION, course)
    # nbgrader runs `alembic` (its database migrations) from PATH: the one installed beside it.
    monkeypatch.setenv("PATH", f"{Path(nbgrader_cli).parent}{os.pathsep}{os.environ['PATH']}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = lambda *args: subprocess.run([nbgrader_cli, *args], cwd=course, capture_output=True, text=True,  # noqa: E731
                                       timeout=300, env=env)
    made = run("generate_assignment", LAB, "--force", "--db", f"sqlite:///{course / 'gradebook.db'}")
    assert made.returncode == 0, made.stdout + made.stderr
    released = course / "release" / LAB / f"{LAB}.ipynb"
    assert labs.BEGIN_MARKER not in released.read_text() and "BEGIN HIDDEN TESTS" not in released.read_text()
    for student, source in {"solution": course / "source" / LAB / f"{LAB}.ipynb", "stub": released}.items():
        target = course / "submitted" / student / LAB / f"{LAB}.ipynb"
        target.parent.mkdir(parents=True)
        shutil.copyfile(source, target)
    graded = run("autograde", LAB, "--create", "--force", "--db", f"sqlite:///{course / 'gradebook.db'}")
    assert graded.returncode == 0, graded.stdout + graded.stderr
    from nbgrader.api import Gradebook

    points = sum(c.points for c in labs.graded_checks(labs.read_notebook(SOLUTION)) if not c.gpu and not c.written)
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as book:
        scores = {s: book.find_submission(LAB, s).score for s in ("solution", "stub")}
    assert scores == {"solution": points, "stub": 0}


def test_the_readmes_slurm_form_names_real_batchspawner_settings():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("On a Slurm cluster, batchspawner starts each JupyterLab as a job:")[1]
    block = block.split("```python\n", 1)[1].split("```", 1)[0]
    from batchspawner import SlurmSpawner
    from traitlets.config import Config

    config = Config()
    exec(block, {"c": config})
    assert config.JupyterHub.spawner_class == "batchspawner.SlurmSpawner"
    assert set(config.SlurmSpawner) <= set(SlurmSpawner.class_trait_names()), set(config.SlurmSpawner)
    assert "--gres={{gres}}" in SlurmSpawner.batch_script.default_value  # one GPU per student's job


# ------------------------------------------------- the hub, through Chromium

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# CI's interpreter lives under /root, which other users cannot enter, so each student's server runs as the
# hub's own user here: the students are kept apart by the hub (each cookie opens one server) and by each
# server's root folder. On a real server they are system users as well (PAM, systemd).
SAME_USER_SPAWNER = '''
load_subconfig({config!r})
from jupyterhub.spawner import LocalProcessSpawner


class SameUserSpawner(LocalProcessSpawner):
    def make_preexec_fn(self, name):
        return None

    def user_env(self, env):
        return {{**env, "USER": self.user.name, "HOME": {exchange!r} + "/" + self.user.name}}


c.JupyterHub.spawner_class = SameUserSpawner
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_port}"
c.Spawner.args = [*c.Spawner.args, "--allow-root"]
c.Spawner.start_timeout = 90
c.Spawner.http_timeout = 90
'''


@pytest.mark.skipif(CHROMIUM is None, reason="no system Chromium: apt-get install chromium")
@pytest.mark.timeout(300)
def test_a_student_logs_in_runs_the_lab_and_submits_through_the_hub(tmp_path):
    import urllib.request

    import playwright.sync_api as playwright_api

    from llmsys.core.dist import free_port

    assert shutil.which("configurable-http-proxy"), "JupyterHub's proxy is missing: npm install -g configurable-http-proxy"
    (tmp_path / "roster.csv").write_text("username,role\nalice,student\nbob,student\nprof,instructor\n")
    ex, hub_dir, port = tmp_path / "exchange", tmp_path / "hub", free_port()
    assert llmsys("labs", "release", "--to", ex, "--users", tmp_path / "roster.csv", "--lab", LAB).returncode == 0
    (ex / "bob" / "secret.txt").write_text("bob's answer")
    made = llmsys("classroom", "hub", "--users", tmp_path / "roster.csv", "--gpus", "2", "--out", hub_dir,
                  "--exchange", ex, "--spawner", "local", "--auth", "shared-password", "--port", port,
                  "--course-env", sys.prefix)
    assert made.returncode == 0, made.stderr
    plan = json.loads((hub_dir / "classroom.json").read_text())
    (hub_dir / "test_config.py").write_text(SAME_USER_SPAWNER.format(
        config=str(hub_dir / "jupyterhub_config.py"), exchange=str(ex), hub_port=free_port(), proxy_port=free_port()))
    password = "class password 123"
    env = {**os.environ, "LLMSYS_HUB_PASSWORD": password, "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    log = open(tmp_path / "hub.log", "wb")
    hub_process = subprocess.Popen([str(Path(sys.executable).parent / "jupyterhub"), "-f", str(hub_dir / "test_config.py")],
                                   cwd=hub_dir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert hub_process.poll() is None, (tmp_path / "hub.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{base}/hub/api", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, (tmp_path / "hub.log").read_text()[-3000:]
                time.sleep(0.5)
        with playwright_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
                "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            try:
                drive_the_hub(page, base, password, plan, ex)
            except BaseException:
                (ROOT / "test-artifacts").mkdir(exist_ok=True)
                page.screenshot(path=str(ROOT / "test-artifacts" / "failed-hub.png"))
                raise
            finally:
                browser.close()
    finally:
        os.killpg(hub_process.pid, 15)  # the hub, its proxy and the students' servers
        try:
            hub_process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(hub_process.pid, 9)
        log.close()
    ledger = exchange.collect(ex, tmp_path / "collected", LAB)
    assert [len(ledger["students"][s]["versions"]) for s in ("alice", "bob")] == [1, 0]


def drive_the_hub(page, base, password, plan, ex):
    import playwright.sync_api as playwright_api

    page.set_default_timeout(90_000)
    page.goto(f"{base}/hub/login")
    page.fill("input[name=username]", "alice")
    page.fill("input[name=password]", password)
    page.click("input[type=submit], button[type=submit]")
    page.wait_for_url(re.compile(r".*/user/alice/lab.*"), timeout=120_000)
    page.goto(f"{base}/user/alice/lab/tree/{LAB}.ipynb")
    page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for()
    idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first
    select = page.get_by_role("button", name="Select Kernel")
    select.or_(idle).wait_for(state="attached", timeout=120_000)
    if select.count():
        select.click()
    idle.wait_for(state="attached", timeout=120_000)
    # A cell of the student's: where this kernel runs and which GPU it was given.
    page.locator(".jp-Cell").nth(1).click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")
    page.keyboard.press("Enter")
    page.keyboard.type('import os; print("GPU", repr(os.environ["CUDA_VISIBLE_DEVICES"]), "at", os.getcwd())')
    page.keyboard.press("Escape")
    output = page.locator(".jp-OutputArea-output", has_text="GPU '").first
    for attempt in range(3):  # Run All stops at the first stub; on a loaded machine a menu click can be lost
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        try:
            output.wait_for(timeout=40_000)
            break
        except playwright_api.TimeoutError:
            assert attempt < 2, "the cell never ran"
    assert output.inner_text().strip() == \
        f"GPU {plan['users']['alice']['environment']['CUDA_VISIBLE_DEVICES']!r} at {ex / 'alice'}"
    page.get_by_role("menuitem", name="File", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Save Notebook\b")).first.click()
    page.locator(".lm-TabBar-tab.jp-mod-dirty").wait_for(state="detached", timeout=30_000)
    # Submit: save a copy of the notebook into submit/ (what File > Save Notebook As does), through the page.
    status = page.evaluate("""async () => {
        const xsrf = document.cookie.split('; ').find(c => c.startsWith('_xsrf=')).split('=')[1];
        const headers = {'X-XSRFToken': xsrf, 'Content-Type': 'application/json'};
        const got = await fetch('/user/alice/api/contents/LAB.ipynb?content=1', {headers});
        const nb = await got.json();
        if (!got.ok || !nb.content) return [got.status, JSON.stringify(nb).slice(0, 300)];
        const put = await fetch('/user/alice/api/contents/submit/LAB.ipynb', {method: 'PUT', headers,
            body: JSON.stringify({type: 'notebook', format: 'json', content: nb.content})});
        const others = await fetch('/user/bob/api/contents/secret.txt?content=1');
        const escape = await fetch('/user/alice/api/contents/..%2Fbob%2Fsecret.txt?content=1');
        return [put.status, others.status, escape.status, await escape.text()];
    }""".replace("LAB", LAB))
    assert len(status) == 4, f"could not read the notebook back: {status}"
    saved, others, escape, escape_body = status
    assert saved in (200, 201)
    assert others in (403, 404) and escape in (400, 403, 404) and "bob's answer" not in escape_body
    submitted = json.loads((ex / "alice" / "submit" / f"{LAB}.ipynb").read_text())
    assert any("CUDA_VISIBLE_DEVICES" in "".join(c["source"]) for c in submitted["cells"])


# ------------------------------------------------- one student's folder never stops the class


def run_main(capsys, *argv):
    from llmsys.__main__ import main

    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def notebook_bytes() -> bytes:
    return STUB.read_bytes()


def test_return_goes_on_past_a_students_linked_feedback_file(tmp_path, capsys):
    for student in ("alice", "bob"):
        (tmp_path / "feedback" / student).mkdir(parents=True)
        (tmp_path / "feedback" / student / f"{LAB}.html").write_text(f"<p>{student}</p>")
        (tmp_path / "ex" / student / "feedback").mkdir(parents=True)
    (tmp_path / "secret").write_text("the instructor's file")
    (tmp_path / "ex" / "alice" / "feedback" / f"{LAB}.html").symlink_to(tmp_path / "secret")
    code, out, _ = run_main(capsys, "labs", "return", "--from", tmp_path / "feedback", "--to", tmp_path / "ex")
    lines = out.splitlines()
    assert code == 1 and "alice:" in lines[0] and "is a link" in lines[0] and "not returned" in lines[0]
    assert lines[1] == f"bob: {LAB}.html returned"
    assert (tmp_path / "secret").read_text() == "the instructor's file"
    assert (tmp_path / "ex" / "bob" / "feedback" / f"{LAB}.html").read_text() == "<p>bob</p>"


def test_release_goes_on_past_a_students_link(tmp_path, capsys):
    (tmp_path / "roster.csv").write_text("username\nalice\nbob\ncarol\n", encoding="utf-8")
    ex = tmp_path / "ex"
    (ex / "bob").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (ex / "bob" / "feedback").symlink_to(tmp_path / "elsewhere")
    (ex / "carol").mkdir()
    (ex / "carol" / f"{LAB}.ipynb").symlink_to(tmp_path / "nowhere")  # a dangling link in place of the lab
    code, out, _ = run_main(capsys, "labs", "release", "--to", ex, "--users", tmp_path / "roster.csv", "--lab", LAB)
    lines = {line.split(":")[0]: line for line in out.splitlines()}
    assert code == 1 and lines["alice"] == f"alice: {LAB}.ipynb released" and (ex / "alice" / f"{LAB}.ipynb").exists()
    assert "is a link" in lines["bob"] and "not released" in lines["bob"]
    assert "is a link" in lines["carol"] and "kept" not in lines["carol"]
    assert not list((tmp_path / "elsewhere").iterdir()) and not (tmp_path / "nowhere").exists()


def test_collect_keeps_the_last_notebook_as_the_graded_copy(tmp_path):
    ex, out = tmp_path / "ex", tmp_path / "out"
    for student in ("alice", "bob"):
        (ex / student / "submit").mkdir(parents=True)
    submission = ex / "alice" / "submit" / f"{LAB}.ipynb"
    submission.write_bytes(notebook_bytes())
    exchange.collect(ex, out, LAB)
    submission.write_bytes(notebook_bytes() + b"\nprint('appended')\n")  # a notebook with text after it
    (ex / "bob" / "submit" / f"{LAB}.ipynb").write_bytes(b"\x00garbage")
    ledger = exchange.collect(ex, out, LAB)
    rows = {row["username"]: row for row in exchange.collected_rows(ledger)}
    assert (out / LAB / "submitted" / "alice" / f"{LAB}.ipynb").read_bytes() == notebook_bytes()
    assert len(list((out / LAB / "history" / "alice").iterdir())) == 2  # the bad version is kept too
    assert rows["alice"]["status"] == rows["bob"]["status"] == "problem"
    assert "not a notebook" in rows["alice"]["problem"] and "not a notebook" in rows["bob"]["problem"]
    assert rows["alice"]["versions"] == 2 and rows["alice"]["submitted_at"] == ledger["students"]["alice"]["versions"][0]["submitted_at"]
    assert not (out / LAB / "submitted" / "bob").exists() and len(list((out / LAB / "history" / "bob").iterdir())) == 1
    submission.write_bytes(notebook_bytes().replace(b"}", b"} ", 1))  # a fixed resubmission clears the flag
    rows = {row["username"]: row for row in exchange.collected_rows(exchange.collect(ex, out, LAB))}
    assert rows["alice"]["status"] == "on time" and rows["alice"]["versions"] == 3


def test_a_changed_deadline_is_announced(tmp_path, capsys):
    (tmp_path / "ex" / "alice" / "submit").mkdir(parents=True)
    argv = ["labs", "collect", "--from", tmp_path / "ex", "--to", tmp_path / "out", "--lab", LAB, "--deadline"]
    assert run_main(capsys, *argv, "2026-12-01T17:00+01:00")[1].count("deadline changed") == 0
    assert "deadline changed" not in run_main(capsys, *argv, "2026-12-01T16:00Z")[1]  # the same moment
    code, out, _ = run_main(capsys, *argv, "2026-12-02T17:00+01:00")
    assert code == 0 and "deadline changed from 2026-12-01T16:00:00.000000Z to 2026-12-02T16:00:00.000000Z" in out


def test_gradebook_leaves_an_unreadable_submission_blank_and_says_who(class_list, tmp_path, capsys):
    unreadable = grading.GradeReport(f"bob/{LAB}.ipynb", "bob", LAB, checks=[
        grading.CheckResult("c0", 2, 0, "not run")], ungraded="not a notebook", salt=7).to_dict()
    reports = [report("alice", [2, 2]), unreadable]
    header, rows = gradebook.gradebook_rows("canvas", reports, class_list)
    assert rows[0][-1] == 4 and rows[1][-1] == ""  # blank, not a zero
    header, rows = gradebook.gradebook_rows("generic", reports, class_list)
    assert rows[1][header.index("score")] == "" and rows[1][header.index("status")] == "ungraded"
    (tmp_path / "roster.csv").write_text(ROSTER, encoding="utf-8")
    (tmp_path / "grades.json").write_text(json.dumps({"submissions": reports}), encoding="utf-8")
    argv = ["classroom", "gradebook", tmp_path / "grades.json", "--users", tmp_path / "roster.csv",
            "--format", "moodle", "--out", tmp_path / "g.csv"]
    code, out, _ = run_main(capsys, *argv)
    assert code == 1 and "not graded" in out and "bob" in out.splitlines()[-1]
    with open(tmp_path / "g.csv", newline="", encoding="utf-8") as f:
        assert {row["Username"]: row[LAB] for row in csv.DictReader(f)}["bob"] == ""
    assert run_main(capsys, *argv, "--allow-ungraded")[0] == 0
    code, _, err = run_main(capsys, *argv[:-1], "/nonexistent/x.csv")
    assert code == 2 and err.count("\n") == 1 and "cannot write --out /nonexistent/x.csv" in err


def test_hub_keeps_an_earlier_config_unless_forced(tmp_path, capsys):
    (tmp_path / "roster.csv").write_text(ROSTER, encoding="utf-8")
    argv = ["classroom", "hub", "--users", tmp_path / "roster.csv", "--gpus", "0", "--out", tmp_path / "hub"]
    assert run_main(capsys, *argv)[0] == 0
    (tmp_path / "hub" / "jupyterhub_config.py").write_text("# edited by hand")
    code, _, err = run_main(capsys, *argv)
    assert code == 2 and "--force" in err and err.count("\n") == 1
    assert (tmp_path / "hub" / "jupyterhub_config.py").read_text() == "# edited by hand"
    assert run_main(capsys, *argv, "--force")[0] == 0
    assert (tmp_path / "hub" / "jupyterhub_config.py").read_text() != "# edited by hand"
