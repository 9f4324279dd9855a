"""The code sandbox against adversarial programs: escapes, fake passes, writes outside the scratch directory,
persistence, secrets, killing the trainer, resource exhaustion and output flooding.

Every adversarial program is a wrong (or no) solution: each must score 0, leave nothing on the host, leak nothing, and
leave this process (the trainer) alive with bounded memory. Correct MBPP- and HumanEval-style solutions score 1.0.
The whole batch is judged in one `code_reward` call, in parallel, as a trainer would.
"""

import errno
import importlib
import json
import logging
import os
import platform
import secrets
import socket
import struct
import sys
import sysconfig
import threading
import time
from pathlib import Path

import psutil
import pytest

from trl_diffusion.rewards import code_reward, code_rewards, code_solved, math_reward, run_tests, workers
from trl_diffusion.rewards import sandbox as sandbox_module
from trl_diffusion.rewards import seccomp as seccomp_module
from trl_diffusion.rewards._sandbox_runner import encode
from trl_diffusion.rewards.sandbox import SandboxLimits, SandboxUnavailableError, check_sandbox, open_sandbox
from trl_diffusion.tasks.hub import humaneval_row, mbpp_row

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux namespaces")

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
WRONG_ADD = "def add(a, b):\n    return a - b\n"
TIMEOUT = 3.0
MARK = "trl_sbx_"  # every file an attack tries to create on the host has this in its name


def answer(code):
    return f"<reasoning>sure</reasoning>\n<answer>\n```python\n{code}\n```\n</answer>"


class Host:
    """What the attacks aim at: a directory with a canary file, a secret file in the home directory and in the
    temporary directory, a secret environment variable, a TCP listener, this process's pid."""

    def __init__(self, directory: Path):
        self.secret = "s3cr3t-" + secrets.token_hex(8)
        self.directory = directory
        self.canary = directory / f"{MARK}canary.txt"
        self.canary.write_text("keep me")
        self.home_secret = Path.home() / f".{MARK}secret"
        self.home_secret.write_text(self.secret)
        self.tmp_secret = directory / f"{MARK}secret.txt"
        self.tmp_secret.write_text(self.secret)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.pid = os.getpid()
        self.site_packages = sorted(
            {sysconfig.get_paths()["purelib"], sysconfig.get_paths(vars={"base": sys.base_prefix})["purelib"]}
        )

    def fill(self, program: str) -> str:
        replacements = {
            "HOSTDIR": str(self.directory),
            "CANARY": str(self.canary),
            "HOMESECRET": str(self.home_secret),
            "TMPSECRET": str(self.tmp_secret),
            "PORT": str(self.port),
            "TRAINER_PID": str(self.pid),
            "SITE_PACKAGES": repr(self.site_packages),
            "MARK": MARK,
        }
        for key, value in replacements.items():
            program = program.replace(key, value)
        return program

    def marked_files(self) -> list[str]:
        places = [self.directory, Path("/tmp"), Path.home(), *map(Path, self.site_packages)]
        found = [str(path) for place in places if place.is_dir() for path in place.iterdir() if MARK in path.name]
        expected = {str(self.canary), str(self.home_secret), str(self.tmp_secret)}
        return sorted(set(found) - expected)

    def connections(self) -> int:
        count = 0
        while True:
            try:
                connection, _ = self.listener.accept()
            except (TimeoutError, BlockingIOError):
                return count
            connection.close()
            count += 1

    def close(self):
        self.listener.close()
        self.home_secret.unlink(missing_ok=True)


LEAK_TESTS = ["assert leak() == 'SECRET'"]  # SECRET is replaced by the secret: only a program that reads it passes

# name -> (program, tests). Programs use the placeholders of `Host.fill`.
ATTACKS = {
    # --- escape: whatever runs, it runs inside the namespaces --------------------------------------------------
    "subinterpreter_shell_and_socket": (
        "import _xxsubinterpreters as interpreters\n"
        "interp = interpreters.create()\n"
        "interpreters.run_string(interp, '''\n"
        "import os, socket\n"
        "os.system('touch HOSTDIR/MARKsubinterp')\n"
        "open('HOSTDIR/MARKsubinterp2', 'w').write('x')\n"
        "socket.create_connection(('127.0.0.1', PORT), timeout=1)\n"
        "''')\n" + WRONG_ADD,
        ADD_TESTS,
    ),
    "subprocess_run": (
        "import subprocess\n"
        "subprocess.run(['sh', '-c', 'touch HOSTDIR/MARKsubprocess; kill -9 TRAINER_PID'])\n" + WRONG_ADD,
        ADD_TESTS,
    ),
    "os_system": ("import os\nos.system('touch HOSTDIR/MARKsystem')\n" + WRONG_ADD, ADD_TESTS),
    "ctypes_libc_system": (
        "import ctypes\nctypes.CDLL(None).system(b'touch HOSTDIR/MARKctypes')\n" + WRONG_ADD,
        ADD_TESTS,
    ),
    "tcp_to_host_listener": (
        "import socket\n"
        "def add(a, b):\n"
        "    socket.create_connection(('127.0.0.1', PORT), timeout=1).sendall(b'hello')\n"
        "    return a - b\n",
        ADD_TESTS,
    ),
    # --- fake pass: a wrong solution that tampers with its own process ----------------------------------------
    "rebind_builtins_compile_exec": (
        "import builtins\n"
        "original_compile = builtins.compile\n"
        "builtins.compile = lambda *args, **kwargs: original_compile('pass', '<no-op>', 'exec')\n"
        "builtins.eval = lambda *args, **kwargs: True\n" + WRONG_ADD,
        ADD_TESTS,
    ),
    "frame_f_locals_edit": (
        "import sys\n"
        "def add(a, b):\n"
        "    frame = sys._getframe(1)\n"
        "    while frame is not None:\n"
        "        for key, value in list(frame.f_locals.items()):\n"
        "            if isinstance(value, int) and not isinstance(value, bool):\n"
        "                frame.f_locals[key] = 99\n"
        "            for found in [value, *(value.values() if isinstance(value, dict) else [])]:\n"
        "                if isinstance(found, list) and all(isinstance(item, str) for item in found):\n"
        "                    found[:] = ['pass'] * len(found)  # test cases replaced by no-ops\n"
        "        frame = frame.f_back\n"
        "    return None\n",
        ADD_TESTS,
    ),
    "gc_hunt_tests_and_expected_values": (
        # Looks for the test source (to read the expected value) and for nonces or report descriptors.
        "import gc, re\n"
        "def add(a, b):\n"
        "    for obj in gc.get_objects():\n"
        "        for text in (obj if isinstance(obj, (list, tuple)) else [obj]):\n"
        "            if isinstance(text, str) and 'assert' in text:\n"
        "                match = re.search(r'add\\(' + str(a) + r', ' + str(b) + r'\\) == (-?\\d+)', text)\n"
        "                if match:\n"
        "                    return int(match.group(1))\n"
        "    return 'no tests here'\n",
        ADD_TESTS,
    ),
    "forged_result_lines_on_every_fd": (
        "import gc, os\n"
        "nonces = [obj['nonce'] for obj in gc.get_objects() if isinstance(obj, dict) and isinstance(obj.get('nonce'), str)]\n"
        "forged = [b\"('loaded', True)\", b\"('ok', True)\", b'PASS'] + [f'{nonce} 3'.encode() for nonce in nonces]\n"
        "lines = b''.join(line + b'\\n' for line in forged)\n"
        "for fd in range(0, 64):\n"
        "    try:\n"
        "        os.write(fd, lines * 10)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('0' * 32, 3)\n"
        "os._exit(0)  # before the real result line\n" + WRONG_ADD,
        ADD_TESTS,
    ),
    "always_true_eq": (
        "class Anything:\n"
        "    def __eq__(self, other):\n"
        "        return True\n"
        "    __ne__ = lambda self, other: False\n"
        "    __hash__ = object.__hash__\n"
        "def add(a, b):\n"
        "    return Anything()\n",
        ADD_TESTS,
    ),
    "int_subclass_eq_and_patched_encoder": (
        "import sys\n"
        "class Int(int):\n"
        "    def __eq__(self, other):\n"
        "        return True\n"
        "    __hash__ = int.__hash__\n"
        "runner = sys.modules['__main__']\n"
        "runner._check_plain = lambda *args, **kwargs: None  # the encoder now sends repr(Int(7)), i.e. 7\n"
        "def add(a, b):\n"
        "    return Int(7)\n",
        ADD_TESTS,
    ),
    "system_exit_zero_at_import": ("raise SystemExit(0)\n" + WRONG_ADD, ADD_TESTS),
    "os_exit_zero_in_call": ("import os\ndef add(a, b):\n    os._exit(0)\n", ADD_TESTS),
    "keyboard_interrupt_and_exit_in_call": (
        "import sys\ndef add(a, b):\n    if a == 1:\n        raise KeyboardInterrupt\n    sys.exit(0)\n",
        ADD_TESTS,
    ),
    # --- writes and deletes outside the scratch directory -------------------------------------------------------
    "os_open_with_dir_fd": (
        "import os\n"
        "try:\n"
        "    fd = os.open('HOSTDIR', os.O_RDONLY)\n"
        "    os.close(os.open('MARKdirfd', os.O_CREAT | os.O_WRONLY, dir_fd=fd))\n"
        "except OSError:\n"
        "    pass\n" + WRONG_ADD,
        ADD_TESTS,
    ),
    "os_remove_with_dir_fd_and_rename": (
        "import os, shutil\n"
        "for attempt in (lambda: os.remove('MARKcanary.txt', dir_fd=os.open('HOSTDIR', os.O_RDONLY)),\n"
        "                lambda: os.rename('CANARY', 'HOSTDIR/MARKmoved'), lambda: shutil.rmtree('HOSTDIR')):\n"
        "    try:\n"
        "        attempt()\n"
        "    except OSError:\n"
        "        pass\n" + WRONG_ADD,
        ADD_TESTS,
    ),
    "sqlite_connect_elsewhere": (
        "import sqlite3\n"
        "for path in ('HOSTDIR/MARKdb.sqlite', '/tmp/MARKdb.sqlite', '/root/MARKdb.sqlite'):\n"
        "    try:\n"
        "        sqlite3.connect(path).execute('create table t (x)')\n"
        "    except Exception:\n"
        "        pass\n" + WRONG_ADD,
        ADD_TESTS,
    ),
    "mkfifo_outside": (
        "import os\ntry:\n    os.mkfifo('HOSTDIR/MARKfifo')\nexcept OSError:\n    pass\n" + WRONG_ADD,
        ADD_TESTS,
    ),
    "pth_into_site_packages": (
        "import os\n"
        "for directory in SITE_PACKAGES:\n"
        "    try:\n"
        "        open(os.path.join(directory, 'MARKevil.pth'), 'w').write('import os; os.system(\"touch /tmp/MARKpth\")')\n"
        "    except OSError:\n"
        "        pass\n" + WRONG_ADD,
        ADD_TESTS,
    ),
    # --- secrets: a program that reads one returns it, and passes ----------------------------------------------
    "secret_environment_variable": (
        "import os\ndef leak():\n    return os.environ.get('TRL_SBX_SECRET', 'none')\n",
        LEAK_TESTS,
    ),
    "secret_proc_parent_environ": (
        "import os\n"
        "def leak():\n"
        "    pids = [os.getppid(), 1, TRAINER_PID] + [int(p) for p in os.listdir('/proc') if p.isdigit()]\n"
        "    for pid in pids:\n"
        "        try:\n"
        "            for entry in open(f'/proc/{pid}/environ', 'rb').read().split(b'\\0'):\n"
        "                if entry.startswith(b'TRL_SBX_SECRET='):\n"
        "                    return entry.split(b'=', 1)[1].decode()\n"
        "        except OSError:\n"
        "            pass\n"
        "    return 'none'\n",
        LEAK_TESTS,
    ),
    "secret_file_in_home": (
        "def leak():\n    try:\n        return open('HOMESECRET').read()\n    except OSError:\n        return 'none'\n",
        LEAK_TESTS,
    ),
    "secret_file_in_tmp": (
        "def leak():\n    try:\n        return open('TMPSECRET').read()\n    except OSError:\n        return 'none'\n",
        LEAK_TESTS,
    ),
    "secret_through_proc_root_of_trainer": (
        "def leak():\n"
        "    for path in ('/proc/TRAINER_PID/root/HOMESECRET', '/proc/1/root/HOMESECRET', '/proc/1/cwd/TMPSECRET'):\n"
        "        try:\n"
        "            return open(path).read()\n"
        "        except OSError:\n"
        "            pass\n"
        "    return 'none'\n",
        LEAK_TESTS,
    ),
    # --- killing the trainer -------------------------------------------------------------------------------------
    "kill_parent_and_trainer": (
        "import os, signal\n"
        "for attempt in (lambda: signal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGKILL),\n"
        "                lambda: os.kill(os.getppid(), signal.SIGKILL), lambda: os.kill(TRAINER_PID, signal.SIGKILL),\n"
        "                lambda: signal.pidfd_send_signal(os.pidfd_open(TRAINER_PID), signal.SIGKILL),\n"
        "                lambda: os.killpg(os.getpgid(TRAINER_PID), signal.SIGKILL), lambda: os.kill(-1, signal.SIGKILL)):\n"
        "    try:\n"
        "        attempt()\n"
        "    except (OSError, ValueError):\n"
        "        pass\n" + WRONG_ADD,
        ADD_TESTS,
    ),
    # --- resource exhaustion -------------------------------------------------------------------------------------
    "fork_bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n" + WRONG_ADD,
        ADD_TESTS,
    ),
    "thread_bomb": (
        "import threading, time\n"
        "threads = []\n"
        "for _ in range(10_000):\n"
        "    try:\n"
        "        thread = threading.Thread(target=time.sleep, args=(60,))\n"
        "        thread.start()\n"
        "        threads.append(thread)\n"
        "    except RuntimeError:\n"
        "        break\n"
        "def add(a, b):\n"
        "    return a - b - len(threads)\n",
        ADD_TESTS,
    ),
    "memory_bomb": ("chunks = []\nwhile True:\n    chunks.append(bytearray(2**26))\n" + WRONG_ADD, ADD_TESTS),
    "infinite_loop": ("def add(a, b):\n    while True:\n        pass\n", ADD_TESTS),
    "huge_file_and_full_scratch": (
        "import os\n"
        "for index in range(10_000):\n"
        "    try:\n"
        "        with open(f'/tmp/MARKbig{index}', 'wb') as file:\n"
        "            for _ in range(64):\n"
        "                file.write(b'x' * 2**20)\n"
        "    except OSError:\n"
        "        pass\n"
        "def add(a, b):\n"
        "    return sum(os.path.getsize('/tmp/' + name) for name in os.listdir('/tmp'))\n",
        ADD_TESTS,
    ),
    # --- output flooding -----------------------------------------------------------------------------------------
    "flood_400mb_stdout": (
        "import os, sys\n"
        "block = b'x' * 2**20\n"
        "for _ in range(400):\n"
        "    sys.stdout.write(block.decode())\n"
        "    os.write(1, block)\n"
        "    os.write(2, block)\n" + WRONG_ADD,
        ADD_TESTS,
    ),
    "flood_400mb_result_channel": (
        # Writes 400 MB to every descriptor, the private result pipe included, without a newline.
        "import os\n"
        "block = b'x' * 2**20\n"
        "def add(a, b):\n"
        "    for fd in range(3, 64):\n"
        "        try:\n"
        "            for _ in range(400):\n"
        "                os.write(fd, block)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return a - b\n",
        ADD_TESTS,
    ),
    "flood_400mb_return_value": ("def add(a, b):\n    return 'x' * 400 * 2**20\n", ADD_TESTS),
}

# Two runs in a row: the first leaves things behind, the second looks for them.
PERSIST_WRITE = (
    "import os, ctypes\n"
    "open('/tmp/MARKpersist', 'w').write('here')\n"
    "try:\n"
    "    open('/dev/shm/MARKpersist', 'w').write('here')\n"
    "except OSError:\n"
    "    pass\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall(248, b'user', b'MARKpersist', b'here', 4, -4)  # add_key to the user keyring\n"
    "try:\n"
    "    os.fork()\n"
    "except OSError:\n"
    "    pass\n"
    "def probe():\n"
    "    return 'written'\n"
)
PERSIST_READ = (
    "import os, ctypes\n"
    "def probe():\n"
    "    libc = ctypes.CDLL(None, use_errno=True)\n"
    "    found = [os.path.exists('/tmp/MARKpersist'), os.path.exists('/dev/shm/MARKpersist'),\n"
    "             libc.syscall(250, 10, -4, b'user', b'MARKpersist', 0) > 0]\n"
    "    return 'found' if any(found) else 'clean'\n"
)

CORRECT = {
    "correct_add": ("def add(a, b):\n    return a + b\n", ADD_TESTS),
    "correct_add_that_prints_and_uses_scratch": (
        "import os\n"
        "print('debug output does not garble the answers')\n"
        "open('notes.txt', 'w').write('scratch is writable')\n"
        "def add(a, b):\n"
        "    assert open('/tmp/notes.txt').read() == 'scratch is writable'\n"
        "    return a + b\n",
        ADD_TESTS,
    ),
}


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    host = Host(tmp_path_factory.mktemp("host"))
    # The judge workers (the sandbox's parents) inherit this secret: restart them so that they have it.
    os.environ["TRL_SBX_SECRET"] = host.secret
    workers._close_pools()
    workers._pools.clear()
    yield host
    del os.environ["TRL_SBX_SECRET"]
    host.close()


def trainer_rss() -> int:
    return psutil.Process().memory_info().rss


def peak_rss(pid: int) -> int:
    """The most memory a process ever held (VmHWM), in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


@pytest.fixture(scope="module")
def batch(host):
    """All attacks and correct solutions judged in one parallel `code_reward` call."""
    cases = {**ATTACKS, **CORRECT}
    names = list(cases)
    completions = [answer(host.fill(cases[name][0])) for name in names]
    tests = [[host.fill(test).replace("SECRET", host.secret) for test in cases[name][1]] for name in names]
    rss_before = trainer_rss()
    start = time.perf_counter()
    rewards = code_reward(completions, tests=tests, timeout_seconds=TIMEOUT, max_workers=2)
    elapsed = time.perf_counter() - start
    judge_peak_rss = [peak_rss(worker.process.pid) for pool in workers._pools.values() for worker in pool._workers]
    return {
        "rewards": dict(zip(names, rewards)),
        "elapsed": elapsed,
        "rss_growth": trainer_rss() - rss_before,
        "judge_peak_rss": judge_peak_rss,
        "connections": host.connections(),
        "marked_files": host.marked_files(),
    }


def test_at_least_25_adversarial_programs_cover_every_category():
    categories = ["subinterpreter", "subprocess", "os_system", "ctypes", "tcp", "builtins", "frame", "gc", "forged",
                  "eq", "exit", "dir_fd", "sqlite", "mkfifo", "pth", "secret", "kill", "fork", "memory", "loop",
                  "file", "flood"]  # fmt: skip
    assert len(ATTACKS) >= 25
    assert all(any(category in name for name in ATTACKS) for category in categories)


@pytest.mark.parametrize("name", list(ATTACKS))
def test_adversarial_program_scores_zero(batch, name):
    assert batch["rewards"][name] == 0.0


@pytest.mark.parametrize("name", list(CORRECT))
def test_correct_program_in_the_same_batch_scores_one(batch, name):
    assert batch["rewards"][name] == 1.0


def test_batch_leaves_nothing_on_the_host_and_the_trainer_alive_with_bounded_memory(batch, host):
    assert batch["marked_files"] == []
    assert host.canary.read_text() == "keep me"
    assert batch["connections"] == 0
    assert psutil.pid_exists(host.pid) and all(pool._workers for pool in workers._pools.values())
    # 400 MB floods and a 1 GiB memory bomb went by: the trainer grew by less than 64 MiB, the judges stayed small.
    assert batch["rss_growth"] < 64 * 2**20
    assert max(batch["judge_peak_rss"]) < 256 * 2**20
    # 34 programs, three of them killed at the 3 s limit (loop, fork and thread bombs), two at a time.
    assert batch["elapsed"] < 45


def test_nothing_persists_from_one_program_to_the_next(host):
    first = code_reward(
        [answer(host.fill(PERSIST_WRITE))], tests=[["assert probe() == 'written'"]], timeout_seconds=TIMEOUT
    )
    second = code_reward(
        [answer(host.fill(PERSIST_READ))], tests=[["assert probe() == 'found'"]], timeout_seconds=TIMEOUT
    )
    control = code_reward(
        [answer(host.fill(PERSIST_READ))], tests=[["assert probe() == 'clean'"]], timeout_seconds=TIMEOUT
    )
    assert (first, second, control) == ([1.0], [0.0], [1.0])
    assert host.marked_files() == []


def test_sandbox_identity_from_inside():
    """What the program sees: uid 65534 for the kernel too, no capabilities, no_new_privs, its own PID namespace, an
    empty environment, and a root with only /usr, the Python prefix, the runner, /proc, /dev and its scratch /tmp."""
    probe = (
        "import errno, os, threading\n"
        "def status(key):\n"
        "    return [line.split()[1] for line in open('/proc/self/status') if line.startswith(key + ':')][0]\n"
        "def facts():\n"
        "    return [os.getuid(), os.getgid(), open('/proc/self/uid_map').read().split(), status('CapEff'),\n"
        "            status('NoNewPrivs'), len([p for p in os.listdir('/proc') if p.isdigit()]), sorted(os.listdir('/')),\n"
        "            sorted(os.environ)]\n"
        "def fork():\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os._exit(0)\n"
        "        return 'forked'\n"
        "    except OSError as error:\n"
        "        return errno.errorcode[error.errno]\n"
        "def thread():\n"
        "    try:\n"
        "        threading.Thread(target=int).start()\n"
        "        return 'started'\n"
        "    except RuntimeError:\n"
        "        return 'refused'\n"
        "def write(directory):\n"
        "    try:\n"
        "        open(os.path.join(directory, 'MARKprobe.pth'), 'w').close()\n"
        "        return 'written'\n"
        "    except OSError as error:\n"
        "        return errno.errorcode[error.errno]\n"
    )
    tests = [
        "uid, gid, uid_map, caps, no_new_privs, processes, root, environment = facts()",
        "assert uid == gid == 65534 and uid_map == ['65534', '65534', '1']",
        "assert caps == '0000000000000000' and no_new_privs == '1'",
        "assert processes <= 3",  # two bwrap inits and the runner
        "assert set(root) <= {'bin', 'dev', 'etc', 'lib', 'lib32', 'lib64', 'libx32', 'opt', 'proc', 'root', 'sbin', 'tmp', 'usr'}",
        "assert set(environment) <= {'LC_CTYPE', 'PWD'}",  # set by the interpreter and bwrap, not inherited
        "assert fork() == 'EAGAIN' and thread() == 'refused'",  # RLIMIT_NPROC: what stops fork and thread bombs
        f"assert write({sysconfig.get_paths()['purelib']!r}) == 'ENOENT'",  # the virtual environment is not there
        f"assert write({sys.base_prefix!r} + '/lib') == 'EROFS'",  # the interpreter's prefix is read-only
        "assert write('/tmp') == 'written'",  # the scratch directory is writable
    ]
    run = run_tests(probe.replace("MARK", MARK), tests)
    assert (run.passed, run.total) == (len(tests), len(tests))


# ---------------------------------------------------------------------------------------------------------------
# Correct solutions: MBPP- and HumanEval-style tasks

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "code" / "tasks.json").read_text())


def test_correct_mbpp_and_humaneval_solutions_score_one_and_wrong_ones_less():
    rows = [mbpp_row(row) for row in FIXTURES["mbpp"]] + [humaneval_row(row) for row in FIXTURES["humaneval"]]
    references = [answer(row["solution"]) for row in rows]
    # Wrong on purpose: the first line of each function body returns None.
    wrong = [answer(row["solution"].replace(":\n    ", ":\n    return None\n    ", 1)) for row in rows]
    rewards = code_reward(
        references + wrong,
        tests=[row["tests"] for row in rows] * 2,
        test_setup=[row["test_setup"] for row in rows] * 2,
        timeout_seconds=10,
        max_workers=2,
    )
    assert rewards[: len(rows)] == [1.0] * len(rows)
    assert all(reward < 1.0 for reward in rewards[len(rows) :])


def test_answers_must_be_plain_data_and_tests_may_use_the_standard_library():
    program = "import math\ndef gen(n):\n    return (i for i in range(n))\ndef area(r):\n    return math.pi * r * r\n"
    tests = ["assert list(gen(3)) == [0, 1, 2]", "assert math.isclose(area(1), 3.14159, rel_tol=1e-4)"]
    assert run_tests(program, tests).passed == 1  # a generator is not plain data; `math` is the real one


# ---------------------------------------------------------------------------------------------------------------
# No silent fallback


def test_without_bubblewrap_code_reward_raises_unless_unsafe_is_explicit(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_module, "find_bwrap", lambda: None)
    check_sandbox.cache_clear()
    try:
        with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap.*unsafe_local_execution=True"):
            code_reward([answer("def add(a, b):\n    return a + b")], tests=[ADD_TESTS], max_workers=1)
        assert code_reward(["no code"], tests=[ADD_TESTS]) == [0.0]  # nothing to run, nothing to raise
        with caplog.at_level(logging.WARNING, logger="trl_diffusion.rewards.code_rewards"):
            run = run_tests("def add(a, b):\n    return a + b", ADD_TESTS, unsafe_local_execution=True)
        assert run.passed == 3 and "WITHOUT isolation" in caplog.text
    finally:
        check_sandbox.cache_clear()


# ---------------------------------------------------------------------------------------------------------------
# Hard timeouts of the worker pool (math_reward and the code judges)


def test_nested_power_math_completion_returns_within_the_timeout_from_a_worker_thread():
    results = {}

    def score():
        start = time.perf_counter()
        results["rewards"] = math_reward(
            [r"<answer>\boxed{2^{2^{2^{2^{2^{2^{10}}}}}}}</answer>", r"<answer>\boxed{4}</answer>"],
            answer=["4", "4"],
            timeout_seconds=3,
        )
        results["elapsed"] = time.perf_counter() - start

    thread = threading.Thread(target=score)
    thread.start()
    thread.join(timeout=60)
    assert results["rewards"] == [0.0, 1.0]
    assert results["elapsed"] < 3 + 2  # one timeout, plus scheduling on a loaded machine


def test_worker_pool_kills_a_job_stuck_in_c_code():
    start = time.perf_counter()
    # `time.sleep` stands for any job that ignores signals: the worker is killed, not interrupted.
    results = workers.map_with_timeout(
        time.sleep, [(60,), (0,)], 1.0, lambda job: "killed", kind="test", max_workers=2
    )
    assert results == ["killed", None]
    assert time.perf_counter() - start < 10
    assert workers.map_with_timeout(time.sleep, [(0,)], 1.0, lambda job: "killed", kind="test", max_workers=2) == [
        None
    ]


def sandbox_processes() -> list[dict]:
    """Live processes of uid 65534 running the sandbox (bwrap or the runner)."""
    return [
        process.info
        for process in psutil.process_iter(["pid", "username", "cmdline", "status"])
        if process.info["username"] == "nobody"
        and process.info["status"] != psutil.STATUS_ZOMBIE
        and "runner.py" in " ".join(process.info["cmdline"] or [])
    ]


def test_sandbox_is_killed_at_the_wall_clock_limit_with_everything_it_started():
    start = time.perf_counter()
    run = run_tests("import time\ndef add(a, b):\n    time.sleep(30)\n", ADD_TESTS, timeout_seconds=1.0)
    assert run.timed_out and run.passed == 0
    assert time.perf_counter() - start < 4
    # The namespace's processes get SIGKILL when its init dies; on a loaded machine they take a moment to exit.
    deadline = time.monotonic() + 5
    while (leftovers := sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers == []


def test_benchmark_script_smoke(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        benchmark = importlib.import_module("code_reward")
    finally:
        sys.path.pop(0)
    payload = benchmark.main(["--smoke", "--output-dir", str(tmp_path), "--workers", "2"])
    saved = json.loads((tmp_path / "code_reward.json").read_text())
    assert saved["points"][0]["completions_per_second"] > 0 and saved["sandbox_startup_ms_median"] > 0
    assert payload["table"].startswith("|")


# ---------------------------------------------------------------------------------------------------------------
# The judge: a candidate's exceptions and return values cannot steer a test

# Tests that call the candidate inside an iterator protocol: a `StopIteration` re-raised there would end the iteration
# early (and `all([])` is True), so each passes vacuously if the judge lets a candidate's exception through.
ITERATOR_SHAPES = {
    "all_map": "assert all(map(lambda n: is_even(n) == (n % 2 == 0), range(10)))",
    "not_any_map": "assert not any(map(lambda n: is_even(n) != (n % 2 == 0), range(10)))",
    "for_over_zip_map": "for n, even in zip(range(10), map(is_even, range(10))):\n    assert even == (n % 2 == 0)",
    "list_filter": "assert list(filter(lambda n: is_even(n) != (n % 2 == 0), range(10))) == []",
    "next_with_default": "assert next(filter(lambda n: is_even(n) != (n % 2 == 0), range(10)), None) is None",
    "sum_map": "assert sum(map(lambda n: is_even(n) != (n % 2 == 0), range(10))) == 0",
    "set_of_map": "assert set(map(lambda n: is_even(n) == (n % 2 == 0), range(10))) <= {True}",
    "comprehension_over_map": "assert [n for n, e in zip(range(10), map(is_even, range(10))) if e != (n % 2 == 0)] == []",
    "min_with_default": "assert min(map(lambda n: is_even(n) == (n % 2 == 0), range(10)), default=True)",
    "iter_with_sentinel": "calls = iter(range(10))\nassert all(iter(lambda: is_even(n := next(calls)) == (n % 2 == 0), None))",
    "generator_expression": "assert all(is_even(n) == (n % 2 == 0) for n in range(10))",
    "sorted_key": "assert sorted(range(6), key=lambda n: not is_even(n)) == [0, 2, 4, 1, 3, 5]",
    "except_exception": "try:\n    assert is_even(3) is False and is_even(4) is True\nexcept Exception:\n    pass",
    "bare_except": "try:\n    assert is_even(3) is False and is_even(4) is True\nexcept:\n    pass",
}
HONEST_IS_EVEN = "def is_even(n):\n    return n % 2 == 0\n"
# Wrong programs whose `is_even` raises or returns something meant to steer the test.
CHEATING_IS_EVEN = {
    "stop_iteration": "def is_even(n):\n    raise StopIteration\n",
    "stop_async_iteration": "def is_even(n):\n    raise StopAsyncIteration\n",
    "generator_exit": "def is_even(n):\n    raise GeneratorExit\n",
    "system_exit": "def is_even(n):\n    raise SystemExit(0)\n",
    "keyboard_interrupt": "def is_even(n):\n    raise KeyboardInterrupt\n",
    "value_error": "def is_even(n):\n    raise ValueError('expected')\n",
    "own_class_named_stop_iteration": (
        "class StopIteration(Exception):\n"
        "    def __str__(self):\n"
        "        return 'True'\n"
        "def is_even(n):\n"
        "    raise StopIteration\n"
    ),
    "stop_iteration_subclass_with_odd_dunders": (
        "class Odd(StopIteration):\n"
        "    __eq__ = lambda self, other: True\n"
        "    __bool__ = lambda self: True\n"
        "    __hash__ = lambda self: 0\n"
        "    __str__ = __repr__ = lambda self: 'True'\n"
        "def is_even(n):\n"
        "    raise Odd\n"
    ),
    "metaclass_forging_the_type_name": (
        "class Meta(type):\n"
        "    __name__ = property(lambda cls: 'StopIteration')\n"
        "class Forged(Exception, metaclass=Meta):\n"
        "    pass\n"
        "def is_even(n):\n"
        "    raise Forged\n"
    ),
    "raise_from_del": (
        "class Bomb:\n    def __del__(self):\n        raise StopIteration\ndef is_even(n):\n    return Bomb()\n"
    ),
    "always_equal_return_value": (
        "class Anything:\n"
        "    __eq__ = lambda self, other: True\n"
        "    __ne__ = lambda self, other: False\n"
        "    __hash__ = lambda self: 0\n"
        "def is_even(n):\n"
        "    return Anything()\n"
    ),
    "bool_raising_stop_iteration": (
        "class Falsy:\n"
        "    def __bool__(self):\n"
        "        raise StopIteration\n"
        "    __eq__ = __ne__ = lambda self, other: self\n"
        "def is_even(n):\n"
        "    return Falsy()\n"
    ),
}


@pytest.fixture(scope="module")
def iterator_batch():
    """In one `code_reward` call: each cheating program on all the shapes (one sandbox each: a failed call does not
    end it, so 0.0 means every shape failed), and the honest program on each shape alone."""
    shapes = list(ITERATOR_SHAPES.values())
    completions = [answer(program) for program in CHEATING_IS_EVEN.values()] + [answer(HONEST_IS_EVEN)] * len(shapes)
    rewards = code_reward(
        completions, tests=[shapes] * len(CHEATING_IS_EVEN) + [[shape] for shape in shapes], max_workers=2
    )
    return {
        "cheating": dict(zip(CHEATING_IS_EVEN, rewards)),
        "honest": dict(zip(ITERATOR_SHAPES, rewards[len(CHEATING_IS_EVEN) :])),
    }


def test_at_least_8_iterator_protocol_shapes_and_every_exception_kind():
    assert len(ITERATOR_SHAPES) >= 8 and len(CHEATING_IS_EVEN) >= 10


@pytest.mark.parametrize("shape", list(ITERATOR_SHAPES))
def test_candidate_exceptions_and_return_values_cannot_fake_a_pass(iterator_batch, shape):
    assert iterator_batch["honest"][shape] == 1.0  # the shape can pass
    assert iterator_batch["cheating"] == dict.fromkeys(CHEATING_IS_EVEN, 0.0)  # no cheating program passes any shape


def test_a_test_that_catches_the_candidates_exception_still_fails():
    """Even a test written to expect an exception fails: a candidate call that raises fails its test."""
    program = "def check(n):\n    if n < 0:\n        raise ValueError\n    return n\n"
    tests = ["assert check(1) == 1", "try:\n    check(-1)\nexcept ValueError:\n    pass"]
    assert run_tests(program, tests).passed == 1


# ---------------------------------------------------------------------------------------------------------------
# The seccomp filter

# x86-64 numbers (asm/unistd_64.h), written out here so that a wrong number in the filter's table fails a test.
DENIED_X86_64 = {
    "add_key": 248, "request_key": 249, "keyctl": 250, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "userfaultfd": 323, "perf_event_open": 298, "ptrace": 101, "bpf": 321, "unshare": 272,
    "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "kexec_load": 246, "kexec_file_load": 320,
    "init_module": 175, "finit_module": 313, "delete_module": 176, "process_vm_readv": 310, "process_vm_writev": 311,
    "pidfd_getfd": 438, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442,
}  # fmt: skip
X32_SYSCALL_BIT = 0x40000000
GETPID = 39
SYSCALL_PROBE = (
    "import ctypes, errno\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    "def call(number, *args):\n"
    "    ctypes.set_errno(0)\n"
    "    args = [ctypes.c_char_p(arg) if isinstance(arg, bytes) else ctypes.c_long(arg) for arg in args]\n"
    "    result = libc.syscall(ctypes.c_long(number), *args, *[ctypes.c_long(0)] * (6 - len(args)))\n"
    "    return errno.errorcode.get(ctypes.get_errno(), 'ERROR') if result == -1 else 'OK'\n"
    "def calls(numbers):\n"
    "    # add_key with valid arguments: it succeeds unfiltered, so only the filter can refuse it\n"
    "    return {number: call(number, b'user', b'trl_sbx_probe', b'data', 4, -4) if number == 248 else call(number)\n"
    "            for number in numbers}\n"
    "def seccomp():\n"
    "    status = dict(line.split(':\\t', 1) for line in open('/proc/self/status').read().splitlines() if ':\\t' in line)\n"
    "    return status['Seccomp'].strip(), status['Seccomp_filters'].strip()\n"
)


def call_in_sandbox(program: str, name: str, *args):
    """What the program's function `name` answers in a real sandbox, through the judge's channel."""
    limits = SandboxLimits(timeout_seconds=TIMEOUT)
    with open_sandbox(check_sandbox(), limits) as sandbox:
        channel = code_rewards._Channel(sandbox)
        assert channel.start() is None
        assert channel.exchange(encode(("", program, limits.rlimits()))) == ("loaded", True)
        return channel.call(name, args, {})


@pytest.fixture(scope="module")
def syscall_errors():
    numbers = [*DENIED_X86_64.values(), X32_SYSCALL_BIT | GETPID, GETPID]
    return call_in_sandbox(SYSCALL_PROBE, "calls", numbers)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 syscall numbers")
@pytest.mark.parametrize("name", list(DENIED_X86_64))
def test_seccomp_denies_the_syscall_from_inside_the_sandbox(syscall_errors, name):
    assert syscall_errors[DENIED_X86_64[name]] in ("EPERM", "ENOSYS")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 syscall numbers")
def test_seccomp_denies_the_x32_abi_and_allows_ordinary_syscalls(syscall_errors):
    assert syscall_errors[X32_SYSCALL_BIT | GETPID] == "EPERM"  # unfiltered: a pid (x32 on) or ENOSYS (x32 off)
    assert syscall_errors[GETPID] == "OK"


def test_seccomp_deny_list_covers_the_required_syscalls():
    assert set(DENIED_X86_64) <= set(seccomp_module.DENIED_SYSCALLS)
    if platform.machine() == "x86_64":
        assert {name: seccomp_module.DENIED_SYSCALLS[name] for name in DENIED_X86_64} == DENIED_X86_64


def run_bpf(program: bytes, number: int, arch: int) -> int:
    """What a classic BPF seccomp program returns for a call (the instructions the filter uses)."""
    data = struct.pack("=iI", number, arch) + bytes(56)  # struct seccomp_data: nr, arch, ip, args[6]
    accumulator, pc = 0, 0
    while True:
        code, jump_true, jump_false, k = struct.unpack_from("=HBBI", program, pc * 8)
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            accumulator, pc = struct.unpack_from("=I", data, k)[0], pc + 1
        elif code in (0x15, 0x35):  # BPF_JMP | BPF_JEQ / BPF_JGE, BPF_K
            taken = accumulator == k if code == 0x15 else accumulator >= k
            pc += 1 + (jump_true if taken else jump_false)
        elif code == 0x06:  # BPF_RET | BPF_K
            return k
        else:
            raise AssertionError(f"unexpected BPF instruction {code:#x}")


def test_seccomp_program_answers_each_syscall_by_number():
    """The filter itself, call by call: also for calls that the kernel refuses an unprivileged process anyway
    (`kexec_load`, `init_module`...), where the sandbox's EPERM does not show the filter at work."""
    program = seccomp_module.build_filter()
    x86_64, i386 = 0xC000003E, 0x40000003
    eperm, allow, kill = 0x00050000 | errno.EPERM, 0x7FFF0000, 0x80000000
    assert {name: run_bpf(program, number, x86_64) for name, number in DENIED_X86_64.items()} == dict.fromkeys(
        DENIED_X86_64, eperm
    )
    assert run_bpf(program, X32_SYSCALL_BIT | GETPID, x86_64) == eperm
    assert [run_bpf(program, number, x86_64) for number in (0, 1, GETPID, 57, 59, 435)] == [allow] * 6
    assert run_bpf(program, 20, i386) == kill


@pytest.mark.skipif(platform.machine() != "x86_64", reason="int 0x80 is the i386 entry of x86-64 kernels")
def test_seccomp_kills_a_program_that_uses_the_i386_syscall_entry():
    program = (
        "import ctypes, mmap\n"
        "def alive():\n"
        "    return 1\n"
        "def i386_getpid():\n"
        "    memory = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
        "    memory.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))  # mov eax, 20 (getpid); int 0x80; ret\n"
        "    return ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(memory)))()\n"
    )
    run = run_tests(program, ["assert alive() == 1", "assert i386_getpid() > 0", "assert alive() == 1"])
    assert run.passed == 1  # killed at the i386 call: the arch check of the filter


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the filter is built for x86-64")
def test_seccomp_filter_is_on_and_ordinary_programs_run():
    program = SYSCALL_PROBE + (
        "import collections, datetime, decimal, fractions, hashlib, itertools, json, random, re, time\n"
        "def ordinary(n):\n"
        "    counts = collections.Counter(re.findall(r'\\w', json.dumps({'n': n, 'd': str(decimal.Decimal(n) / 3)})))\n"
        "    digest = hashlib.sha256(str(sorted(counts.items())).encode()).hexdigest()\n"
        "    open('scratch.txt', 'w').write(digest)\n"
        "    random.seed(n)\n"
        "    return [len(open('scratch.txt').read()), sum(itertools.islice(itertools.count(), n)),\n"
        "            str(fractions.Fraction(n, 4)), datetime.date(2024, 1, n).isoformat(), time.monotonic() > 0]\n"
    )
    tests = [
        "assert seccomp() == ('2', '1')",  # filter mode, one filter
        "assert ordinary(2) == [64, 1, '1/2', '2024-01-02', True]",
    ]
    assert run_tests(program, tests).passed == 2


# ---------------------------------------------------------------------------------------------------------------
# A sandbox that fails to start is not a wrong program


@pytest.fixture
def broken_bwrap(tmp_path, monkeypatch):
    """A bwrap that fails as it does once the kernel refuses its namespaces, used after the real start-up check
    passed; the programs are judged in this process, so that the fake is the one they get."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: Creating new namespace failed: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(0o755)
    check_sandbox()
    monkeypatch.setattr(code_rewards, "check_sandbox", lambda: str(fake))
    monkeypatch.setattr(code_rewards, "map_with_timeout", lambda function, jobs, *args, **kwargs: [
        function(*job) for job in jobs
    ])  # fmt: skip
    monkeypatch.setattr(code_rewards, "_consecutive_sandbox_failures", 0)
    return fake


def test_sandbox_failures_are_counted_logged_and_unscored(broken_bwrap, caplog):
    honest = answer("def add(a, b):\n    return a + b")
    metrics = {}
    with caplog.at_level(logging.WARNING, logger="trl_diffusion.rewards.code_rewards"):
        rewards = code_reward([honest, "no code"], tests=[ADD_TESTS] * 2, log_metric=metrics.__setitem__)
    assert rewards == [None, 0.0]  # not the program's fault: unscored, not 0
    assert metrics == {"code_reward/sandbox_failures": 1.0}
    assert "Creating new namespace failed" in caplog.text and "sandbox" in caplog.text
    run = run_tests("def add(a, b):\n    return a + b", ADD_TESTS)
    assert run.sandbox_failed and run.passed == 0


def test_consecutive_sandbox_failures_stop_the_run(broken_bwrap, monkeypatch):
    honest = answer("def add(a, b):\n    return a + b")
    assert code_solved([honest] * 2, tests=[ADD_TESTS] * 2, max_consecutive_sandbox_failures=3) == [None, None]
    with pytest.raises(SandboxUnavailableError, match="3 consecutive.*Creating new namespace failed"):
        code_reward([honest], tests=[ADD_TESTS], max_consecutive_sandbox_failures=3)
    # One sandbox that starts resets the count.
    monkeypatch.setattr(code_rewards, "check_sandbox", check_sandbox)
    assert code_reward([honest], tests=[ADD_TESTS], max_consecutive_sandbox_failures=3) == [1.0]
    assert code_rewards._consecutive_sandbox_failures == 0


# ---------------------------------------------------------------------------------------------------------------
# Limits are checked


@pytest.mark.parametrize(
    "argument, value",
    [
        ("timeout_seconds", 0),
        ("timeout_seconds", -1),
        ("timeout_seconds", float("nan")),
        ("timeout_seconds", float("inf")),
        ("timeout_seconds", "5"),
        ("timeout_seconds", True),
        ("timeout_seconds", 1e300),  # finite, but no RLIMIT_CPU holds it
        ("memory_limit_mb", 0),
        ("memory_limit_mb", -5),
        ("memory_limit_mb", 512.5),
        ("memory_limit_mb", True),
        ("memory_limit_mb", 2**50),  # 2**70 bytes: past RLIMIT_AS
        ("max_workers", 0),
        ("max_workers", -1),
        ("max_workers", 2.0),
        ("max_workers", True),
        ("max_consecutive_sandbox_failures", 0),
    ],
)
def test_bad_limits_are_refused_with_the_argument_named(argument, value):
    honest = answer("def add(a, b):\n    return a + b")
    with pytest.raises(ValueError, match=f"`{argument}`"):
        code_reward([honest], tests=[ADD_TESTS], **{argument: value})
    if argument != "max_consecutive_sandbox_failures":
        with pytest.raises(ValueError, match=f"`{argument}`"):
            code_solved(["no code"], tests=[ADD_TESTS], **{argument: value})
    if argument in ("timeout_seconds", "memory_limit_mb"):
        with pytest.raises(ValueError, match=f"`{argument}`"):
            run_tests("def add(a, b):\n    return a + b", ADD_TESTS, **{argument: value})
