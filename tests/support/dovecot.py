"""A real IMAP server for the tests: Debian's dovecot (`apt-get install dovecot-imapd`),
started from a generated configuration in a temporary directory: one user with a static
password, a maildir in that directory, plain IMAP on a free loopback port. Runs as root (the
mail user is then an unprivileged system user, so the directory is a world-traversable one
of its own: pytest's tmp_path is under a 0700 directory that user cannot enter) or as
anyone (everything runs as them)."""
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DOVECOT = shutil.which("dovecot") or "/usr/sbin/dovecot"
USER, PASSWORD = "sender@example.org", "imap-test-password"

CONFIG = """\
protocols = imap
listen = 127.0.0.1
base_dir = {root}/run
state_dir = {root}/state
log_path = {root}/dovecot.log
info_log_path = {root}/dovecot.log
ssl = no
disable_plaintext_auth = no
auth_mechanisms = plain login
default_login_user = {login_user}
default_internal_user = {internal_user}
first_valid_uid = {uid}
first_valid_gid = {gid}
mail_location = maildir:{root}/mail/%n
service imap-login {{
  inet_listener imap {{
    address = 127.0.0.1
    port = {port}
  }}
  inet_listener imaps {{
    port = 0
  }}
}}
service anvil {{
  chroot =
}}
service imap-login {{
  chroot =
}}
passdb {{
  driver = static
  args = password={password}
}}
userdb {{
  driver = static
  args = uid={uid} gid={gid} home={root}/mail/%n
}}
namespace inbox {{
  inbox = yes
  mailbox Sent {{
    special_use = \\Sent
  }}
}}
"""


def available() -> bool:
    return os.path.exists(DOVECOT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Dovecot:
    def __init__(self):
        self.root = root = Path(tempfile.mkdtemp(prefix="orch-dovecot-"))
        self.port = _free_port()
        self.user, self.password = USER, PASSWORD
        if os.geteuid() == 0:
            # Dovecot never runs mail processes as root: the mail user is an unprivileged one.
            mail = pwd.getpwnam("dovecot") if _exists("dovecot") else pwd.getpwnam("nobody")
            uid, gid = mail.pw_uid, mail.pw_gid
            login_user = "dovenull" if _exists("dovenull") else mail.pw_name
            internal_user = mail.pw_name
        else:
            me = pwd.getpwuid(os.geteuid())
            uid, gid, login_user, internal_user = me.pw_uid, me.pw_gid, me.pw_name, me.pw_name
        for sub in ("run", "state", "mail"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o755)
        if os.geteuid() == 0:
            os.chown(root / "mail", uid, gid)
        self.config = root / "dovecot.conf"
        self.config.write_text(CONFIG.format(root=root, port=self.port, password=PASSWORD, uid=uid, gid=gid,
                                             login_user=login_user, internal_user=internal_user))
        self.process = subprocess.Popen([DOVECOT, "-F", "-c", str(self.config)], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    if conn.recv(100).startswith(b"* OK"):
                        break
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"dovecot did not start: {self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        out = self.process.stdout.read().decode(errors="replace") if self.process.poll() is not None else ""
        path = self.root / "dovecot.log"
        return out + (path.read_text(errors="replace") if path.exists() else "")

    def settings(self, settings, folder: str = "Sent") -> None:
        settings.EMAIL_IMAP_HOST, settings.EMAIL_IMAP_PORT = "127.0.0.1", self.port
        settings.EMAIL_IMAP_USE_SSL = False
        settings.EMAIL_IMAP_USER, settings.EMAIL_IMAP_PASSWORD = self.user, self.password
        settings.EMAIL_IMAP_SENT_FOLDER = folder

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def _exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False
