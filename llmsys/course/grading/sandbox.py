"""One sandbox per submission: the student's kernel runs in fresh Linux namespaces.

``sandbox_argv`` wraps a kernel command in ``unshare`` (util-linux): new mount,
PID, network, IPC and UTS namespaces. Inside, this file runs as a small init
(PID 1) that builds a new root on a tmpfs and then starts the kernel:

- read-only bind mounts of what the kernel needs and nothing else: the system's
  ``/usr`` (and ``/lib*``), the Python installation, the ``llmsys`` package
  folder alone (not the repository: no ``solutions/``, no tests, no other
  submissions), the model cache; a made-up ``/etc`` (the sandbox's own passwd);
- a private ``/tmp`` and home (tmpfs with a size cap: a disk bomb fills them);
- a network namespace whose only interface is loopback (torch.distributed
  still rendezvous on 127.0.0.1; nothing outside can be reached);
- its own user id (the grader runs as root; each sandbox gets a uid of its own)
  or, without root, a user namespace; no new privileges, no set-uid binaries;
- resource limits (address space, file size, processes, CPU time, core dumps);
- an environment built from an allow-list.

When the kernel exits, or the grader kills ``unshare``, the init exits and the
kernel takes every process of the namespace with it (``--kill-child`` and the
PID namespace): nothing the submission started outlives its grading.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import json
import os
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

SANDBOX_UID_BASE = 200_000  # each sandbox runs as its own uid above this (no such user exists)
TMPFS_BYTES = 512 * 2**20  # the private /tmp (home and working folder live there)
LIMITS = {  # per process; address space is generous because torch maps much more than it touches
    "RLIMIT_AS": 12 * 2**30,
    "RLIMIT_FSIZE": 256 * 2**20,
    "RLIMIT_NPROC": 512,
    "RLIMIT_CORE": 0,
    "RLIMIT_NOFILE": 4096,
}
DEVICES = ["null", "zero", "full", "random", "urandom", "tty"]
PASSED_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET", "LANG")
HOME = "/tmp/home"
WORKDIR = "/tmp/work"

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38


class SandboxUnavailable(RuntimeError):
    """This machine cannot make the sandbox; the message says why."""


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None when sandboxes can be made here, else why not (shown to the instructor)."""
    if not sys.platform.startswith("linux"):
        return f"the sandbox needs Linux namespaces; this is {sys.platform}"
    if shutil.which("unshare") is None:
        return "the sandbox needs `unshare` (util-linux), which is not installed"
    probe = [*_unshare_prefix(), sys.executable, "-I", "-c", "import socket"]
    try:
        result = subprocess.run(probe, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"`unshare` could not run: {err}"
    if result.returncode != 0:
        why = result.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        return f"this machine does not allow new namespaces ({why[0]})"
    return None


def _unshare_prefix() -> list[str]:
    namespaces = ["--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "--kill-child"]
    if os.geteuid() != 0:  # an unprivileged user gets root inside a user namespace of its own
        namespaces = ["--user", "--map-root-user", *namespaces]
    return ["unshare", *namespaces, "--"]


def sandbox_argv(config_path: Path) -> list[str]:
    """The command that starts the init with the sandbox described in ``config_path``."""
    return [*_unshare_prefix(), sys.executable, "-I", "-S", __file__, str(config_path)]


def write_config(path: Path, *, root: Path, kernel_dir: Path, argv: list[str], slot: int,
                 readonly: list[str], cpu_seconds: int, env: dict[str, str]) -> None:
    """Describe one sandbox for the init: ``argv`` runs in ``kernel_dir``'s connection."""
    config = {"root": str(root), "kernel_dir": str(kernel_dir), "argv": argv, "uid": SANDBOX_UID_BASE + slot,
              "readonly": readonly, "cpu_seconds": cpu_seconds, "env": env}
    path.write_text(json.dumps(config), encoding="utf-8")


def kernel_env(extra: dict[str, str]) -> dict[str, str]:
    """The kernel's environment: an allow-list, never the grader's own."""
    env = {key: os.environ[key] for key in PASSED_ENV if key in os.environ}
    env.update(HOME=HOME, TMPDIR="/tmp", USER="student", LOGNAME="student", LC_ALL="C.UTF-8",
               PATH=f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", MPLBACKEND="Agg",
               IPYTHONDIR=f"{HOME}/.ipython", JUPYTER_PLATFORM_DIRS="1", PYDEVD_DISABLE_FILE_VALIDATION="1",
               PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


def python_paths() -> list[str]:
    """Folders the interpreter needs: the virtual environment and the Python it was made from."""
    found = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(sys.executable).resolve().parent.parent)}
    return sorted(found)


# ------------------------------------------------------------ inside the namespaces


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [s.encode() if s is not None else None for s in (source, target, fstype, data)]
    if _libc().mount(args[0], args[1], args[2], flags, args[3]) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")


def _bind(new_root: Path, source: str, writable: bool = False) -> None:
    """Bind ``source`` at the same path inside the new root, read-only unless asked."""
    if not os.path.exists(source):
        return
    target = new_root / source.lstrip("/")
    if os.path.isdir(source):
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch(exist_ok=True)
    _mount(source, str(target), None, MS_BIND | MS_REC)
    if not writable:
        _mount("none", str(target), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _system_folders(new_root: Path) -> None:
    """``/usr`` and friends read-only; top-level symlinks (``/lib -> usr/lib``) copied as links."""
    for name in ["usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"]:
        path = Path("/") / name
        if path.is_symlink():
            (new_root / name).symlink_to(os.readlink(path))
        elif path.is_dir():
            _bind(new_root, str(path))


def _etc(new_root: Path, uid: int) -> None:
    """A made-up /etc: the loader's cache and a passwd that names only the sandbox user."""
    etc = new_root / "etc"
    etc.mkdir()
    for name in ["ld.so.cache", "ld.so.conf", "localtime"]:
        if os.path.isfile(f"/etc/{name}"):
            shutil.copyfile(f"/etc/{name}", etc / name)
    if os.path.isdir("/etc/ld.so.conf.d"):
        shutil.copytree("/etc/ld.so.conf.d", etc / "ld.so.conf.d")
    (etc / "passwd").write_text(f"root:x:0:0::/root:/bin/false\nstudent:x:{uid}:{uid}::{HOME}:/bin/false\n")
    (etc / "group").write_text(f"root:x:0:\nstudent:x:{uid}:\n")
    (etc / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
    (etc / "hostname").write_text("sandbox\n")


def _dev(new_root: Path) -> None:
    dev = new_root / "dev"
    dev.mkdir()
    _mount("tmpfs", str(dev), "tmpfs", MS_NOSUID, "mode=755,size=1m")
    for name in DEVICES + sorted(p.name for p in Path("/dev").glob("nvidia*")):
        if os.path.exists(f"/dev/{name}"):
            (dev / name).touch()
            _mount(f"/dev/{name}", str(dev / name), None, MS_BIND)
    (dev / "shm").mkdir()
    _mount("tmpfs", str(dev / "shm"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=256m")
    for name, target in [("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")]:
        (dev / name).symlink_to(target)


def _loopback_up() -> None:
    """Bring up ``lo`` in the new network namespace (it starts down)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    finally:
        sock.close()


def build_root(config: dict) -> Path:
    new_root = Path(config["root"])
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", str(new_root), "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=16m")
    _system_folders(new_root)
    # the private /tmp first: a checkout or virtualenv that lives under /tmp is bound on top of it
    (new_root / "tmp").mkdir()
    _mount("tmpfs", str(new_root / "tmp"), "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={TMPFS_BYTES}")
    for path in config["readonly"]:
        _bind(new_root, path)
    _etc(new_root, config["uid"])
    _dev(new_root)
    if any(Path("/dev").glob("nvidia*")):  # the CUDA driver reads the GPU's topology there
        _bind(new_root, "/sys")
    (new_root / "proc").mkdir()
    _mount("proc", str(new_root / "proc"), "proc", MS_NOSUID | MS_NODEV)
    _bind(new_root, config["kernel_dir"], writable=True)
    return new_root


def _drop_privileges(config: dict) -> None:
    """In the kernel's process, before exec: limits, then the sandbox's own uid."""
    os.setsid()  # its own process group: the grader interrupts the kernel's group only
    for name, value in {**LIMITS, "RLIMIT_CPU": config["cpu_seconds"]}.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if os.getuid() == 0 and not _in_user_namespace():
        os.setgroups([])
        os.setgid(config["uid"])
        os.setuid(config["uid"])
    _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    for folder in (HOME, WORKDIR):
        os.makedirs(folder, exist_ok=True)
    os.chdir(WORKDIR)


def _in_user_namespace() -> bool:
    try:
        return Path("/proc/self/uid_map").read_text().split()[:3] != ["0", "0", "4294967295"]
    except OSError:
        return False


def init(config_path: str) -> int:
    """PID 1 of the sandbox: build the root, start the kernel, wait for it, then exit (killing the rest)."""
    config = json.loads(Path(config_path).read_text(encoding="utf-8"))
    new_root = build_root(config)
    _loopback_up()
    os.chroot(str(new_root))
    os.chdir("/")
    pid = os.fork()
    if pid == 0:
        try:
            _drop_privileges(config)
            os.execve(config["argv"][0], config["argv"], config["env"])
        finally:
            os._exit(127)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is for the kernel, not for the init
    while True:  # reap orphans until the kernel itself exits
        try:
            done, status = os.wait()
        except ChildProcessError:
            return 0
        if done == pid:
            return os.waitstatus_to_exitcode(status) & 0xFF


if __name__ == "__main__":
    sys.exit(init(sys.argv[1]))
