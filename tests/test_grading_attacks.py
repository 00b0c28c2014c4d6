"""Submissions written to cheat or to attack the machine, each graded to the score it deserves.

Every attack is a lab00 submission: the student copy (no answers, deserves 0)
or the correct fixture (deserves every CPU point) with attack cells added. The
whole class is graded once, by the command line with ``--jobs 2`` and
``--json``/``--csv``, as an instructor would; each test reads its report and
what is left on the machine afterwards.
"""

import csv
import hashlib
import json
import secrets
import socket
import tempfile
import threading
import time
from pathlib import Path

import nbformat
import pytest

from llmsys.course import grading
from test_grading import processes_mentioning  # tests/ is on sys.path: pytest puts it there

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "labs" / "lab00_warmup.ipynb"
CORRECT = ROOT / "tests" / "fixtures" / "submissions" / "correct_lab00_warmup.ipynb"
PACKAGE = ROOT / "llmsys" / "course" / "grading"
FULL = 6  # lab00's CPU points
CANARY = secrets.token_hex(8)  # a secret the grader's user can read, never a student
MARKER = "llmsys-attack-" + secrets.token_hex(4)  # in the argv of every process an attack starts

pytestmark = pytest.mark.skipif(grading.unavailable_reason() is not None,
                                reason=f"no sandbox on this machine: {grading.unavailable_reason()}")

WRONG_ANSWERS = {  # answers that run but are wrong; the kernel is then made to say they are right
    "rmsnorm-solution": "def rms_norm(x, weight, eps=1e-6):\n    return x * weight",
    "memory-solution": "def bytes_per_param_mixed_adam():\n    return 14\n\n"
                       "def training_memory_gb(n_params):\n    return n_params * 14 / 1e9",
}

SILENCE_TRACEBACKS = "get_ipython().showtraceback = lambda *a, **k: None\nget_ipython().showsyntaxerror = lambda *a, **k: None"
CUSTOM_EXCEPTION_HANDLER = "get_ipython().set_custom_exc((BaseException,), lambda shell, etype, value, tb, tb_offset=None: None)"
INPUT_TRANSFORMER = """
def neutralise(lines):
    text = "".join(lines)
    return ["pass\\n"] if "Graded check" in text or "__llmsys" in text else lines
get_ipython().input_transformers_post.append(neutralise)
"""
PATCHED_COMPARISONS = """
import math, torch
torch.testing.assert_close = lambda *a, **k: None
torch.equal = lambda *a, **k: True
math.isclose = lambda *a, **k: True
"""
ALWAYS_EQUAL = """
class AlwaysEqual(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
def bytes_per_param_mixed_adam():
    return AlwaysEqual(0)
def training_memory_gb(n_params):
    return AlwaysEqual(0)
"""
FORGED_RECORDS = PATCHED_COMPARISONS + """
import os
from IPython.display import publish_display_data
MIME = "application/vnd.llmsys.probe+json"
def forge(info):
    for cell in ["rmsnorm_matches_reference", "rmsnorm_eps", "bytes_per_param", "training_memory_7b"]:
        publish_display_data({MIME: {"cell": cell, "event": "begin"}})
        zeros = {"int": "0"}
        publish_display_data({MIME: {"cell": cell, "event": "asserts",
                                     "asserts": [{"k": k, "values": {"0": zeros, "1": zeros}} for k in range(4)]}})
        publish_display_data({MIME: {"cell": cell, "event": "end"}})
get_ipython().events.register("pre_run_cell", forge)
for name in ["results.jsonl", "grades.json", "grades.csv", "/tmp/results.jsonl"]:
    with open(name, "w") as f:
        f.write('{"event": "result", "outcome": {"status": "passed"}}\\n' * 100)
"""


def background_writer(report_paths: list[Path]) -> str:
    """A cell that starts a detached process rewriting the reports and the grader's own code."""
    targets = [str(p) for p in report_paths] + [str(PACKAGE / "report.py"), str(PACKAGE / "classroom.py")]
    loop = (f"import time\\ntargets = {targets!r}\\nwhile True:\\n"
            "    for t in targets:\\n        try:\\n            open(t, 'a').write('pwned')\\n"
            "        except OSError:\\n            pass\\n    time.sleep(0.2)")
    return (f"import subprocess, sys\n"
            f"subprocess.Popen(['setsid', sys.executable, '-c', \"{loop}\", {MARKER!r}], start_new_session=True,\n"
            f"                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
            f"subprocess.Popen([sys.executable, '-c', 'import os, time\\nif os.fork(): os._exit(0)\\nos.setsid()\\n"
            f"time.sleep(600)', {MARKER!r}])")


def secret_reader(canary_file: Path) -> str:
    """A cell that gathers what a student must not see and carries it out in an error message."""
    return f"""
import glob, os
found = []
for path in [{str(canary_file)!r}, {str(ROOT / "solutions" / "lab00_warmup.ipynb")!r}, "/etc/passwd", "/etc/shadow",
             *glob.glob(os.path.expanduser("~/.ssh/*")), *glob.glob("/root/.ssh/*"), *glob.glob("/proc/*/cmdline"),
             *glob.glob("/proc/*/environ")]:
    try:
        found.append(path + ": " + open(path, "rb").read(300).decode("utf-8", "replace"))
    except OSError:
        pass
raise RuntimeError(" || ".join(found))
"""


def network(port: int) -> str:
    return f"""
import socket
reached = []
for host, port in [("127.0.0.1", {port}), ("10.0.0.1", 80), ("1.1.1.1", 53)]:
    try:
        socket.create_connection((host, port), timeout=2).close()
        reached.append(host)
    except OSError:
        pass
try:
    socket.getaddrinfo("pypi.org", 443)
    reached.append("dns")
except OSError:
    pass
assert not reached, reached
"""


MEMORY_BOMB = "x = bytearray(16 << 30)  # 16 GiB, zero pages that are never touched"
DISK_BOMB = """
chunk = b"x" * (1 << 20)
for name in ["big.bin", "/tmp/big.bin"]:
    with open(name, "wb") as f:
        for _ in range(300):  # 300 MB each
            f.write(chunk)
"""
CLASSMATES = """
import glob, os, signal
for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
    if pid not in (1, os.getpid(), os.getppid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
for folder in glob.glob("/tmp/llmsys-grade-*") + glob.glob("/tmp/*/kernel"):
    open(os.path.join(folder, "forged"), "w").write("x")
"""
PROBE_HIJACK = PATCHED_COMPARISONS + """
real_probe = __llmsys_probe__
class Hijack:  # copies any expected value the kernel holds over the student's operand, and says every assert held
    def __getattr__(self, name):
        return getattr(real_probe, name)
    def operands(self, k, pairs):
        found = [globals()[name] for name in ("want", "expected", "reference") if name in globals()]
        return real_probe.operands(k, [(j, (lambda: found[0]) if found else thunk) for j, thunk in pairs])
    def probe(self, k, result=True):
        values = real_probe.pending.get(k, {})
        for actual, expected in (("0", "1"), ("1", "2")):
            if expected in values:
                values[actual] = values[expected]
        real_probe.probe(k)
        return True
    def last(self, k, j, value):
        real_probe.v(k, 1, value)
        real_probe.pending[k]["0"] = real_probe.pending[k]["1"]
        real_probe.probe(k)
        return value
__llmsys_probe__ = Hijack()
"""
LYING_TENSOR = PATCHED_COMPARISONS + """
import torch
class Liar(torch.Tensor):  # read back as whatever the kernel calls expected
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        want = globals().get("want")
        if getattr(func, "__name__", "") in ("detach", "cpu", "numpy", "clone") and want is not None:
            return want
        return super().__torch_function__(func, types, args, kwargs or {})
def rms_norm(x, weight, eps=1e-6):
    return (x * weight).as_subclass(Liar)
torch.Tensor.detach = lambda self: globals().get("want", self)
"""
FLOOD = """
from IPython.display import publish_display_data
for _ in range(48):  # 48 records of 10 MB: more than a grader should hold for one student
    publish_display_data({"application/vnd.llmsys.probe+json": {"cell": "rmsnorm_eps", "event": "x", "pad": "x" * 10_000_000}})
"""
OVERSIZED_CHECK_OUTPUT = """
from IPython.display import publish_display_data
def rms_norm(x, weight, eps=1e-6):
    publish_display_data({"application/vnd.llmsys.probe+json": {"cell": "rmsnorm_matches_reference", "event": "x",
                                                                "pad": "x" * 20_000_000}})
    publish_display_data({"application/vnd.llmsys.probe+json": {"cell": "rmsnorm_eps", "event": "x",
                                                                "pad": "x" * 20_000_000}})
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight
"""
OBFUSCATED_LIBRARY_ANSWER = ('import importlib\nRMS = importlib.import_module("llm" + "sys.core.model").RMSNorm\n'
                             'def rms_norm(x, weight, eps=1e-6):\n    norm = RMS(x.shape[-1], eps=eps)\n'
                             '    norm.weight.data = weight\n    return norm(x)')
LIBRARY_ANSWER = ("from llmsys.core.model import RMSNorm\n\ndef rms_norm(x, weight, eps=1e-6):\n"
                  "    norm = RMSNorm(x.shape[-1], eps=eps)\n    norm.weight.data = weight\n    return norm(x)")


def build(path: Path, base: Path, cells: list[str] = (), answers: dict | None = None) -> Path:
    """``base`` with ``cells`` added after its first cell and answer cells replaced by id."""
    nb = nbformat.read(str(base), as_version=4)
    for cell in nb.cells:
        if answers and cell.get("id") in answers:
            cell.source = answers[cell.get("id")]
    first_code = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    for offset, source in enumerate(cells, start=1):
        nb.cells.insert(first_code + offset, nbformat.v4.new_code_cell(source))
    nbformat.write(nb, str(path))
    return path


# name: (base, attack cells, answers replaced, score deserved)
def attacks(tmp: Path, port: int) -> dict:
    reports = [tmp / "grades.json", tmp / "grades.csv"]
    return {
        "silenced_tracebacks": (STUB, [SILENCE_TRACEBACKS], None, 0),
        "custom_exception_handler": (STUB, [CUSTOM_EXCEPTION_HANDLER], None, 0),
        "input_transformer": (STUB, [INPUT_TRANSFORMER], None, 0),
        "patched_comparisons": (STUB, [PATCHED_COMPARISONS], WRONG_ANSWERS, 0),
        "always_equal": (STUB, [], {"memory-solution": ALWAYS_EQUAL}, 0),
        "forged_records": (STUB, [FORGED_RECORDS], WRONG_ANSWERS, 0),
        "background_processes": (CORRECT, [background_writer(reports)], None, FULL),
        "reads_secrets": (CORRECT, [secret_reader(tmp / "canary.txt")], None, FULL),
        "network": (CORRECT, [network(port)], None, FULL),
        "memory_bomb": (CORRECT, [MEMORY_BOMB], None, FULL),
        "disk_bomb": (CORRECT, [DISK_BOMB], None, FULL),
        "kills_classmates": (CORRECT, [CLASSMATES], None, FULL),
        "classmate": (CORRECT, [], None, FULL),
        "library_answer": (CORRECT, [], {"rmsnorm-solution": LIBRARY_ANSWER}, FULL - 3),
        "obfuscated_library_answer": (CORRECT, [], {"rmsnorm-solution": OBFUSCATED_LIBRARY_ANSWER}, FULL - 3),
        "probe_hijack": (STUB, [PROBE_HIJACK], WRONG_ANSWERS, 0),
        "lying_tensor": (STUB, [], {"rmsnorm-solution": LYING_TENSOR,
                                        "memory-solution": WRONG_ANSWERS["memory-solution"]}, 0),
        "flood": (CORRECT, [FLOOD], None, FULL),
        "oversized_check_output": (CORRECT, [], {"rmsnorm-solution": OVERSIZED_CHECK_OUTPUT}, FULL - 3),
    }


# Tuning tasks and checks whose operand is a measurement: the kernel is made to measure whatever the
# student likes (patched clocks, byte counters, losses, evaluators, reference optimizers); the grader
# measures the choice itself, in a process of its own. Each is the solution with one answer cell replaced.
FREE_LUNCH_SETTING = """
import time
from llmsys.course import tasks
class NoBytes:  # a LiveBytes that never sees a byte
    peak = 0
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        return False
tasks.LiveBytes = NoBytes
ticks = iter(range(10**9))
tasks.cpu_seconds = time.process_time = lambda: next(ticks) * 1e-6  # every step takes a microsecond
def choose_setting():
    return {"checkpointing": False, "micro_batch": 16}  # 74 MB against the 12 MB budget
"""
FROZEN_SCALE = """
import torch
class LossScaler:  # a scale that never changes
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale_value = float(init_scale)
    def scale(self, loss):
        return loss * self.scale_value
    def unscale_(self, params) -> bool:
        found_inf = False
        for p in params:
            if p.grad is not None:
                p.grad.div_(self.scale_value)
                found_inf |= not torch.isfinite(p.grad).all().item()
        return found_inf
    def update(self, found_inf: bool) -> None:
        pass
    def step(self, optimizer, params) -> bool:
        found_inf = self.unscale_(list(params))
        if not found_inf:
            optimizer.step()
        return not found_inf
class FrozenGradScaler:  # torch.amp.GradScaler, made to agree
    def __init__(self, device="cpu", init_scale=2.0**16, growth_interval=2000, **kwargs):
        self.inner = LossScaler(init_scale)
    def scale(self, loss):
        return self.inner.scale(loss)
    def step(self, optimizer):
        self.inner.step(optimizer, [p for group in optimizer.param_groups for p in group["params"]])
    def update(self):
        pass
    def get_scale(self):
        return self.inner.scale_value
torch.amp.GradScaler = FrozenGradScaler
"""
DIVERGING_LR = """
import torch
import torch.nn.functional as F
F.cross_entropy = lambda *args, **kwargs: torch.zeros((), requires_grad=True)  # every loss the kernel computes is 0
def choose_hyperparameters():
    return {"lr": 3.0, "weight_decay": 0.0}  # held-out loss about 1400; the solution's choice about 0.97
"""
NO_TRAINING = """
said = iter([1.0])  # the library's evaluator says 1.0 before training, 0.0 after
distill.evaluate_reverse_kl = lambda *args, **kwargs: next(said, 0.0)
def on_policy_step(student, teacher, optimizer, prompts, max_new_tokens, generator=None):
    return 0.5
"""
NO_ORTHOGONALISATION = """
import torch
torch.optim._muon._zeropower_via_newtonschulz = lambda update, *args, **kwargs: update  # torch's Muon agrees
@torch.no_grad()
def muon_step(param, grad, momentum_buffer, lr, momentum=0.95, weight_decay=0.1, nesterov=True):
    momentum_buffer.lerp_(grad, 1 - momentum)
    update = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer  # newton_schulz(U) = U
    rows, cols = param.shape
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-lr * math.sqrt(max(1.0, rows / cols)))
"""
PATCHED_COST_MODEL = """
from types import SimpleNamespace
modelled = lambda problem, choice: SimpleNamespace(fits=True, step_time=0.0, reason="")  # every choice fits, fast
def choose_layout(cfg, gpus, seq_len, batch_tokens, cluster):
    return Layout(dp=gpus), "selective", 1  # pure data parallelism: 70B's states do not fit
"""
PATCHED_PASS_RATE = """
said = iter(range(10**6))
pass_rate = lambda policy, task: float(next(said) % 2)  # 0.0 before training, 1.0 after
def train_on_budget(policy, tokenizer, task, sample_budget, seed=0):
    return policy  # no training
"""
POOR_QUANTIZATION = """
compression.perplexity = lambda *args, **kwargs: 1.0  # every perplexity the kernel measures is 1
def choose_quantization():
    return {"method": "rtn", "bits": 2, "group": "channel"}  # fits; perplexity about 117, the solution's about 88
"""
# name: (lab, answers replaced by cell id, the checks that must score 0, every other check in full)
MEASUREMENT_ATTACKS = {
    "patched_clock_and_bytes": ("lab01_zero", {"budget-code": FREE_LUNCH_SETTING, "scaler-code": FROZEN_SCALE},
                                {"step_fits_the_budget_at_speed", "loss_scale_schedule_matches_gradscaler"}),
    "patched_loss": ("lab07_adamw", {"tune-code": DIVERGING_LR}, {"tuned_loss_near_the_solutions"}),
    "patched_evaluator": ("lab05_distill", {"05b668c6": NO_TRAINING}, {"on_policy_tiny_run"}),
    "patched_reference_optimizer": ("lab08_muon", {"7ff6f853": NO_ORTHOGONALISATION},
                                    {"muon_one_step", "muon_matches_torch"}),
    "patched_cost_model": ("lab02_parallel", {"layout-code": PATCHED_COST_MODEL}, {"layout_is_fast_and_fits"}),
    # trainer_is_seeded fails as it should: the policy did not change
    "patched_pass_rate": ("lab06_grpo", {"eb3c59a1": PATCHED_PASS_RATE},
                          {"trainer_raises_first_digit", "trainer_raises_next_digit", "trainer_is_seeded"}),
    "patched_perplexity": ("lab10_quant", {"6084ba22": POOR_QUANTIZATION}, {"quant_tuned_perplexity_near_the_solutions"}),
}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Grade every attack in one run of the command line; the reports, and what was true afterwards."""
    tmp = tmp_path_factory.mktemp("attacks")
    (tmp / "canary.txt").write_text(CANARY)
    server = socket.create_server(("127.0.0.1", 0))
    connections = []
    threading.Thread(target=lambda: connections.append(server.accept()), daemon=True).start()
    class_dir = tmp / "class"
    class_dir.mkdir()
    cases = attacks(tmp, server.getsockname()[1])
    for name, (base, cells, answers, _) in cases.items():
        build(class_dir / f"{name}_lab00_warmup.ipynb", base, cells, answers)
    package_before = {p.name: digest(p) for p in PACKAGE.glob("*.py")}
    work = Path(tempfile.mkdtemp(prefix="llmsys-attack-work-"))  # the sandboxes' folders, to check they go
    tempfile.tempdir, saved = str(work), tempfile.tempdir
    try:
        code = grading.main([str(class_dir), "--jobs", "2", "--cell-timeout", "60", "--timeout", "300",
                             "--json", str(tmp / "grades.json"), "--csv", str(tmp / "grades.csv")])
    finally:
        tempfile.tempdir = saved
    written = {p.name: p.read_bytes() for p in (tmp / "grades.json", tmp / "grades.csv")}
    time.sleep(2)  # a surviving writer would strike within 0.2 s
    after = {
        "code": code,
        "reports_unchanged": all((tmp / name).read_bytes() == data for name, data in written.items()),
        "survivors": processes_mentioning(MARKER),
        "package_unchanged": {p.name: digest(p) for p in PACKAGE.glob("*.py")} == package_before,
        "connections": len(connections),
        "leftovers": sorted(work.iterdir()),
    }
    server.close()
    work.rmdir()
    data = json.loads(written["grades.json"])
    reports = {s["student"]: s for s in data["submissions"]}
    return cases, reports, after, tmp


def text_of(report: dict) -> str:
    """What a report says (its notes and messages), not where the file was."""
    return "\n".join([*report["notes"], *(c["message"] for c in report["checks"])])


def test_every_attack_gets_the_score_it_deserves(graded):
    cases, reports, after, _ = graded
    assert after["code"] == 0
    got = {name: reports[name]["score"] for name in cases}
    deserved = {name: case[3] for name, case in cases.items()}
    print("\nattack                      got / deserved")
    for name in cases:
        print(f"{name:<28}{got[name]:>3} / {deserved[name]}")
    assert got == deserved
    assert all(reports[name]["max_score"] == FULL for name in cases)


def test_nothing_a_submission_started_outlives_its_grading(graded):
    _, _, after, _ = graded
    assert after["survivors"] == []
    assert after["reports_unchanged"], "a process rewrote the reports after the grader wrote them"
    assert after["package_unchanged"], "a submission changed the grader's code"


def test_secrets_stay_out_of_the_reports(graded):
    _, reports, _, tmp = graded
    report = text_of(reports["reads_secrets"])
    assert "RuntimeError" in report  # the cell ran and failed, carrying out whatever it could read
    assert CANARY not in report and "BEGIN SOLUTION" not in report and "rsqrt" not in report
    assert "daemon:" not in report and str(tmp) not in report and "pytest" not in report, report
    assert "/etc/passwd: root:x:0:0::/root:/bin/false" in report  # the sandbox's own, made-up passwd


def test_no_connection_leaves_the_sandbox(graded):
    _, reports, after, _ = graded
    assert after["connections"] == 0
    assert "AssertionError" not in text_of(reports["network"])  # every attempt failed inside, too


def test_bombs_hit_the_limits(graded):
    _, reports, after, _ = graded
    assert "MemoryError" in text_of(reports["memory_bomb"])
    assert "tried to use more memory than the limit, which the sandbox blocks" in text_of(reports["memory_bomb"])
    assert "File too large" in text_of(reports["disk_bomb"]) or "No space left" in text_of(reports["disk_bomb"])
    assert after["leftovers"] == []  # every sandbox's folder is gone


def test_forged_records_and_silenced_errors_are_reported_as_failures(graded):
    _, reports, _, _ = graded
    for name in ["silenced_tracebacks", "custom_exception_handler", "input_transformer", "patched_comparisons",
                 "always_equal", "forged_records", "probe_hijack", "lying_tensor"]:
        assert all(c["status"] == grading.STATUS_FAILED and c["message"] for c in reports[name]["checks"]
                   if not c["gpu"]), reports[name]
    messages = " ".join(c["message"] for c in reports["patched_comparisons"]["checks"])
    assert "the grader's evaluation failed" in messages
    always_equal = {c["id"]: c["message"] for c in reports["always_equal"]["checks"]}
    assert "the grader's evaluation failed" in always_equal["bytes_per_param"]  # in the kernel, 0 == 16 held
    lying = {c["id"]: c["message"] for c in reports["lying_tensor"]["checks"]}
    assert "subclass of torch.Tensor" in lying["rmsnorm_matches_reference"]


def test_outputs_over_the_caps_fail_their_check_and_are_not_kept(graded):
    _, reports, _, _ = graded
    checks = {c["id"]: c for c in reports["oversized_check_output"]["checks"]}
    for check_id in ["rmsnorm_matches_reference", "rmsnorm_eps"]:
        assert checks[check_id]["score"] == 0 and "over the grader's cap" in checks[check_id]["message"]
    assert reports["flood"]["score"] == FULL  # its records were dropped, not judged: a cell of its own sent them


def test_every_report_holds_the_salt_that_repeats_the_grading(graded):
    _, reports, _, tmp = graded
    salts = {report["salt"] for report in reports.values()}
    assert len(salts) == 1 and isinstance(next(iter(salts)), int)
    with open(tmp / "grades.csv", newline="", encoding="utf-8") as f:
        assert {int(r["salt"]) for r in csv.DictReader(f)} == salts


def test_a_library_answer_is_not_there_to_call(graded):
    _, reports, _, _ = graded
    checks = {c["id"]: c for c in reports["library_answer"]["checks"]}
    for check_id in ["rmsnorm_matches_reference", "rmsnorm_eps"]:
        assert checks[check_id]["score"] == 0
        assert "not available in this lab: write it yourself (llmsys.core.model.RMSNorm)" in checks[check_id]["message"]
    obfuscated = {c["id"]: c for c in reports["obfuscated_library_answer"]["checks"]}
    assert all("not available in this lab" in obfuscated[c]["message"] for c in ["rmsnorm_matches_reference", "rmsnorm_eps"])


def test_the_grade_table_holds_every_submission_and_its_hash(graded):
    cases, reports, _, tmp = graded
    with open(tmp / "grades.csv", newline="", encoding="utf-8") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    assert set(rows) == set(cases)
    for name in cases:
        assert rows[name]["sha256"] == digest(tmp / "class" / f"{name}_lab00_warmup.ipynb")
        assert int(rows[name]["total"]) == reports[name]["score"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Every measurement attack graded in one run of the command line, with the solutions' runs beside them."""
    class_dir = tmp_path_factory.mktemp("measurement-attacks")
    for name, (lab, answers, _) in MEASUREMENT_ATTACKS.items():
        build(class_dir / f"{name}_{lab}.ipynb", ROOT / "solutions" / f"{lab}.ipynb", answers=answers)
    out = class_dir / "grades.json"
    assert grading.main([str(class_dir), "--jobs", "2", "--cell-timeout", "120", "--timeout", "600",
                         "--json", str(out)]) == 0
    return {s["student"]: s for s in json.loads(out.read_text())["submissions"]}


@pytest.mark.parametrize("name", MEASUREMENT_ATTACKS)
def test_a_measurement_the_kernel_forges_scores_nothing(measured, name):
    _, _, cheated = MEASUREMENT_ATTACKS[name]
    checks = {c["id"]: c for c in measured[name]["checks"]
              if c["status"] != grading.STATUS_SKIPPED and not c["written"]}
    print(f"\n{name}: {measured[name]['score']} / {measured[name]['max_score']}",
          {c: checks[c]["message"][:120] for c in cheated})
    assert {c for c in cheated if checks[c]["score"] > 0} == set()
    assert all(checks[c]["status"] == grading.STATUS_FAILED and checks[c]["message"] for c in cheated)
    short = {c: check["message"] for c, check in checks.items() if c not in cheated and check["score"] != check["points"]}
    assert short == {}

