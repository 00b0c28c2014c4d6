"""The autograder: each submission runs in its own sandbox; the grader judges plain data.

``python -m llmsys grade SUBMISSION... [--csv grades.csv] [--json [PATH]] [--jobs N]``

- ``submission``: read and hash a submission, tell its student and its lab;
- ``merge``: the student's code cells with the lab's graded checks in place;
- ``probes``: graded cells rewritten twice: the solution's run sends every
  operand, a student's run only the student's own (``sides``: which those are;
  the kernel never computes an expected value); ``solution_run(x)``: x as the
  solution measured it in the same grading, for tuning tasks;
- ``measurements``: ``measure(task, choice)``: a tuning task's choice, measured
  by the grader in a clean process of its own (how to declare one: its docstring);
- ``encoder``: what the kernel sends values with, installed before student code;
- ``judge``: the grader's own evaluation of each assert, on plain data;
- ``sandbox``: the Linux namespaces, mounts and limits one submission runs in;
- ``kernel``: the kernel in the sandbox, driven from the grader (timeouts, reruns);
- ``answers``: the student's copy of the library, without the lab's declared answers;
- ``written``: written answers, pending for the instructor, and their scores merged back;
- ``classroom``: the whole grading of a class; ``scoring``: one submission's
  checks and notes; ``report``: reports and tables;
- ``cli``: the command line.

GPU-only checks (tag ``gpu``) are skipped on a machine without CUDA and shown
as "skipped: no GPU"; their points count toward the maximum only where they run.
"""

from .classroom import DEFAULT_CELL_TIMEOUT, DEFAULT_TIMEOUT, MAX_RERUNS, expand_submissions, grade, grade_many, has_gpu
from .cli import main
from .measurements import measure, tuning_task
from .merge import NO_GPU, merge
from .probes import solution_run
from .report import (MESSAGE_LIMIT, STATUS_FAILED, STATUS_NOT_RUN, STATUS_PASSED, STATUS_PENDING, STATUS_SCORED,
                     STATUS_SKIPPED, CheckResult, GradeReport, grades_json, summary_table, write_csv)
from .sandbox import SandboxUnavailable, unavailable_reason
from .scoring import KERNEL_DIED
from .submission import GradingSetupError, find_lab_file, find_reference, student_name
from .written import read_scores

__all__ = [
    "main", "grade", "grade_many", "expand_submissions", "has_gpu", "merge", "find_lab_file", "find_reference",
    "student_name", "GradeReport", "CheckResult", "summary_table", "write_csv", "grades_json", "GradingSetupError",
    "SandboxUnavailable", "unavailable_reason", "NO_GPU", "MESSAGE_LIMIT", "KERNEL_DIED", "MAX_RERUNS",
    "DEFAULT_CELL_TIMEOUT", "DEFAULT_TIMEOUT", "STATUS_PASSED", "STATUS_FAILED", "STATUS_SKIPPED", "STATUS_NOT_RUN",
    "STATUS_PENDING", "STATUS_SCORED", "read_scores", "solution_run", "measure", "tuning_task",
]
