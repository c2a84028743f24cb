"""Did-you-mean for environment knobs: a misspelt variable is silently ignored by every library.

The names each library reads come from the installed code where possible: ``DS_BUILD_<OP>`` from
the installed deepspeed's op builders (``BUILD_VAR``, see :mod:`.env`), ``PYTORCH_*`` and
``TORCH_*`` from the C strings of the installed torch's ``libc10.so`` plus the ``TORCH_NCCL_*``
table of :mod:`.timeouts`, and ``NCCL_*`` from NCCL's documented variables (NCCL is a binary we
cannot read names from reliably). A set variable that is not a known name but is close to one
(``difflib`` ratio >= ``CUTOFF``) is reported with the name it probably meant; an unknown name
close to nothing is left alone (a newer library may read it).
"""

from __future__ import annotations

import difflib
import mmap
import re
from collections.abc import Mapping
from dataclasses import dataclass

from troubleshooter.doctor.versions import package_dir

CUTOFF = 0.85
PREFIXES = ("DS_BUILD_", "NCCL_", "TORCH_", "PYTORCH_")

#: NCCL's documented environment variables (NCCL 2.2x user guide, "Environment Variables"), plus
#: the legacy torch names that still start with NCCL_.
NCCL_NAMES = frozenset("""
NCCL_DEBUG NCCL_DEBUG_SUBSYS NCCL_DEBUG_FILE NCCL_SOCKET_IFNAME NCCL_SOCKET_FAMILY
NCCL_SOCKET_NTHREADS NCCL_NSOCKS_PERTHREAD NCCL_SOCKET_RETRY_CNT NCCL_SOCKET_RETRY_SLEEP_MSEC
NCCL_CROSS_NIC NCCL_IB_HCA NCCL_IB_TIMEOUT NCCL_IB_RETRY_CNT NCCL_IB_GID_INDEX NCCL_IB_ADDR_FAMILY
NCCL_IB_ADDR_RANGE NCCL_IB_ROCE_VERSION_NUM NCCL_IB_SL NCCL_IB_TC NCCL_IB_FIFO_TC
NCCL_IB_RETURN_ASYNC_EVENTS NCCL_OOB_NET_ENABLE NCCL_OOB_NET_IFNAME NCCL_UID_STAGGER_THRESHOLD
NCCL_UID_STAGGER_RATE NCCL_NET NCCL_NET_PLUGIN NCCL_TUNER_PLUGIN NCCL_PROFILER_PLUGIN
NCCL_ENV_PLUGIN NCCL_IGNORE_CPU_AFFINITY NCCL_CONF_FILE NCCL_HOSTID NCCL_IB_DISABLE
NCCL_IB_AR_THRESHOLD NCCL_IB_QPS_PER_CONNECTION NCCL_IB_SPLIT_DATA_ON_QPS NCCL_IB_CUDA_SUPPORT
NCCL_IB_PCI_RELAXED_ORDERING NCCL_IB_ADAPTIVE_ROUTING NCCL_IB_ECE_ENABLE NCCL_IB_MERGE_NICS
NCCL_IB_MERGE_VFS NCCL_NET_GDR_LEVEL NCCL_NET_GDR_READ NCCL_NET_SHARED_BUFFERS NCCL_NET_SHARED_COMMS
NCCL_SINGLE_RING_THRESHOLD NCCL_LL_THRESHOLD NCCL_TREE_THRESHOLD NCCL_ALGO NCCL_PROTO
NCCL_NVB_DISABLE NCCL_PXN_DISABLE NCCL_P2P_PXN_LEVEL NCCL_P2P_DISABLE NCCL_P2P_LEVEL
NCCL_P2P_DIRECT_DISABLE NCCL_P2P_NET_CHUNKSIZE NCCL_P2P_LL_THRESHOLD NCCL_P2P_READ_ENABLE
NCCL_P2P_USE_CUDA_MEMCPY NCCL_SHM_DISABLE NCCL_SHM_USE_CUDA_MEMCPY NCCL_SHM_MEMCPY_MODE
NCCL_SHM_LOCALITY NCCL_BUFFSIZE NCCL_NTHREADS NCCL_MAX_NCHANNELS NCCL_MIN_NCHANNELS NCCL_MAX_CTAS
NCCL_MIN_CTAS NCCL_CGA_CLUSTER_SIZE NCCL_CHECKS_DISABLE NCCL_CHECK_POINTERS NCCL_LAUNCH_MODE
NCCL_TOPO_FILE NCCL_TOPO_DUMP_FILE NCCL_TOPO_DUMP_FILE_RANK NCCL_GRAPH_FILE NCCL_GRAPH_DUMP_FILE
NCCL_GRAPH_DUMP_FILE_RANK NCCL_COLLNET_ENABLE NCCL_COLLNET_NODE_THRESHOLD NCCL_NVLS_ENABLE
NCCL_NVLS_CHUNKSIZE NCCL_CUMEM_ENABLE NCCL_CUMEM_HOST_ENABLE NCCL_DMABUF_ENABLE NCCL_MNNVL_ENABLE
NCCL_MNNVL_UUID NCCL_MNNVL_CLIQUE_ID NCCL_COMM_BLOCKING NCCL_RUNTIME_CONNECT NCCL_LOCAL_REGISTER
NCCL_GRAPH_REGISTER NCCL_LEGACY_CUDA_REGISTER NCCL_SET_STACK_SIZE NCCL_SET_THREAD_NAME
NCCL_GRAPH_MIXING_SUPPORT NCCL_WORK_FIFO_DEPTH NCCL_WORK_FIFO_BYTES NCCL_WIN_ENABLE NCCL_RAS_ENABLE
NCCL_RAS_ADDR NCCL_RAS_TIMEOUT_FACTOR NCCL_ASYNC_ERROR_HANDLING NCCL_BLOCKING_WAIT NCCL_TIMEOUT
""".split())
_C_NAME = re.compile(rb"((?:PYTORCH|TORCH)_[A-Z0-9_]{3,60})\0")


@dataclass(frozen=True)
class Typo:
    """A set variable no library reads, and the known name it is closest to."""

    name: str
    suggestion: str
    reader: str  # who reads the suggested name


def torch_c_names() -> frozenset[str]:
    """``PYTORCH_*`` / ``TORCH_*`` C strings of the installed torch's libc10 (allocator, logging)."""
    root = package_dir("torch")
    names: set[str] = set()
    for lib in sorted((root / "lib").glob("libc10.so*")) if root else ():
        try:
            with lib.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                names.update(m.decode() for m in _C_NAME.findall(data))
        except (OSError, ValueError):
            continue
    return frozenset(names)


def known_names(build_vars: set[str], build_setup: set[str], torch_knobs: set[str]) -> dict[str, tuple[frozenset[str], str]]:
    """prefix -> (the names read, who reads them)."""
    torch_names = torch_c_names() | torch_knobs
    return {
        "DS_BUILD_": (frozenset(build_vars | build_setup), "deepspeed's setup.py"),
        "NCCL_": (NCCL_NAMES, "NCCL"),
        "TORCH_": (frozenset(n for n in torch_names if n.startswith("TORCH_")), "torch"),
        "PYTORCH_": (frozenset(n for n in torch_names if n.startswith("PYTORCH_")), "torch"),
    }


def typos(env: Mapping[str, str], known: dict[str, tuple[frozenset[str], str]]) -> list[Typo]:
    """The set variables that are near misses of a known name, by prefix."""
    found = []
    for name in sorted(env):
        prefix = next((p for p in PREFIXES if name.startswith(p)), None)
        if prefix is None:
            continue
        names, reader = known[prefix]
        if not names or name in names:
            continue
        # A misspelt prefix still counts: PYTORCH_CUDA_ALOC_CONF is near PYTORCH_CUDA_ALLOC_CONF.
        pool = set(names) | (known["PYTORCH_"][0] if prefix == "TORCH_" else set())
        close = difflib.get_close_matches(name, sorted(pool), n=1, cutoff=CUTOFF)
        if close:
            owner = next(r for p, (ns, r) in known.items() if close[0] in ns)
            found.append(Typo(name, close[0], owner))
    return found
