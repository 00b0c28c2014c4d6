# JupyterHub configuration written by `python -m llmsys classroom hub`; the class is in classroom.json beside it.
# Start: `jupyterhub -f jupyterhub_config.py` (as root, so each student's server runs as that student).
import json
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
plan = json.loads((HERE / "classroom.json").read_text(encoding="utf-8"))
c = get_config()  # noqa: F821  (JupyterHub defines it)

c.JupyterHub.ip = plan["ip"]
c.JupyterHub.port = plan["port"]
c.JupyterHub.db_url = f"sqlite:///{HERE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(HERE / "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.pid_file = str(HERE / "jupyterhub-proxy.pid")

# Who may log in: the class list's students, and its instructors as admins.
c.JupyterHub.authenticator_class = plan["authenticator"]
c.Authenticator.allowed_users = set(plan["users"])
c.Authenticator.admin_users = set(plan["admins"])
if plan["authenticator"] == "shared-password":  # one password for the class, from the hub's environment
    c.SharedPasswordAuthenticator.user_password = os.environ["LLMSYS_HUB_PASSWORD"]
    c.Authenticator.admin_users = set()  # admins would need a second, longer password

# Each student's JupyterLab: the course's environment (installed once, read-only), their own folder.
c.JupyterHub.spawner_class = plan["spawner_class"]
c.Spawner.cmd = [str(Path(plan["course_env"]) / "bin" / "jupyterhub-singleuser")]
c.Spawner.default_url = "/lab"
c.Spawner.notebook_dir = str(Path(plan["exchange"]) / "{username}")
c.Spawner.cpu_limit = float(plan["cpus"])
c.Spawner.mem_limit = plan["memory"]
c.Spawner.args = [
    f"--MappingKernelManager.cull_idle_timeout={plan['idle_seconds']}",
    "--MappingKernelManager.cull_interval=300",
    f"--ServerApp.shutdown_no_activity_timeout={plan['idle_seconds']}",
]
if plan["spawner"] == "systemd":
    c.SystemdSpawner.readonly_paths = [plan["course_env"]]
    c.SystemdSpawner.isolate_tmp = True
    c.SystemdSpawner.isolate_devices = False  # the GPUs are devices
    c.SystemdSpawner.disable_user_sudo = True


def give_student_their_share(spawner):
    """The student's GPU (or MIG slice), memory share and thread count, as classroom.json promised."""
    entry = plan["users"][spawner.user.name]
    for key, value in entry["environment"].items():
        spawner.environment[key] = value.replace("{site}", str(HERE / "site"))


c.Spawner.pre_spawn_hook = give_student_their_share
