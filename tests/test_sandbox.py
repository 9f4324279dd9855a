"""The code sandbox against adversarial programs: escapes, fake passes, writes outside the scratch directory,
persistence, secrets, killing the trainer, resource exhaustion and output flooding.

Every adversarial program is a wrong (or no) solution: each must score 0, leave nothing on the host, leak nothing, and
leave this process (the trainer) alive with bounded memory. Correct MBPP- and HumanEval-style solutions score 1.0.
The whole batch is judged in one `code_reward` call, in parallel, as a trainer would.
"""

import importlib
import json
import logging
import os
import secrets
import socket
import sys
import sysconfig
import threading
import time
from pathlib import Path

import psutil
import pytest

from trl_diffusion.rewards import code_reward, math_reward, run_tests, workers
from trl_diffusion.rewards import sandbox as sandbox_module
from trl_diffusion.rewards.sandbox import SandboxUnavailableError, check_sandbox
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
