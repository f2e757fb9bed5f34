"""Which GPUs can reach each other over NVLink: the precondition of copy-engine transfers.

`nvlink_domain()` names the NVLink domain of this process's GPU; `in_one_nvlink_domain(group)`
is the collective check that every rank of a group shares one.

How the domain is named:
    NVLink fabric  GPUs attached to an NVLink fabric (GB200/GB300 NVL72 racks) report a fabric
                   cluster UUID and clique id through NVML once the fabric manager has registered
                   them. GPUs with the same pair are NVLink peers, also across hosts of one rack.
    host name      everything else. This assumes the GPUs of one host are NVLink peers, which holds
                   on HGX/DGX-style boards (H100/H200 SXM with NVSwitch) but NOT on PCIe-only boxes,
                   where peers talk over PCIe and copy-engine pushes are slow or impossible.

Why NVML is read in a subprocess: the fabric query exists in two forms
(`nvmlDeviceGetGpuFabricInfo` and the `...V` variant taking a versioned struct); the wrong form for
the installed driver can crash the calling process rather than return an error (seen on an H200
whose fabric state is NOT_SUPPORTED). The probe therefore runs once per GPU in a child Python
process with a timeout, and its answer is cached. Any failure (nvidia-ml-py missing, NVMLError, a
crashed or hung probe, a fabric that is not registered) falls back to the host name and logs why;
the caller never sees an exception from NVML.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 30.0

# Runs in a child interpreter: prints one JSON line {"domain": "..."} or {"reason": "..."}.
_PROBE_SOURCE = r"""
import json, sys
try:
    import pynvml
except ImportError as exc:
    print(json.dumps({"reason": f"nvidia-ml-py is not installed ({exc})"})); sys.exit(0)
try:
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByUUID(sys.argv[1])
    if all(hasattr(pynvml, n) for n in ("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfoV_t",
                                         "nvmlGpuFabricInfo_v2")):
        import ctypes
        info = pynvml.c_nvmlGpuFabricInfoV_t()
        info.version = pynvml.nvmlGpuFabricInfo_v2
        pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
    else:
        info = pynvml.nvmlDeviceGetGpuFabricInfo(handle)
    completed = getattr(pynvml, "NVML_GPU_FABRIC_STATE_COMPLETED", 3)
    if info.state != completed or info.status != pynvml.NVML_SUCCESS:
        print(json.dumps({"reason": f"fabric state {info.state}, status {info.status}"}))
        sys.exit(0)
    uuid = bytes(info.clusterUuid).hex()
    if not uuid.strip("0"):
        print(json.dumps({"reason": "fabric cluster UUID is all zeros"})); sys.exit(0)
    print(json.dumps({"domain": f"nvlink-fabric:{uuid}:{info.cliqueId}"}))
except pynvml.NVMLError as exc:
    print(json.dumps({"reason": f"NVML: {exc}"}))
"""


def _host_domain() -> str:
    return socket.gethostname()


def _run_probe(gpu_uuid: str) -> tuple[str | None, str]:
    """Run the NVML fabric probe in a child process: (domain or None, reason when None)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE_SOURCE, gpu_uuid],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"the NVML probe could not run ({exc})"
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        return None, f"the NVML probe exited with status {proc.returncode} ({tail[0]})"
    lines = proc.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return None, f"the NVML probe printed no answer ({proc.stdout.strip()[:200]!r})"
    if "domain" in answer:
        return str(answer["domain"]), ""
    return None, str(answer.get("reason", "unknown"))


@functools.cache
def _fabric_domain(gpu_uuid: str) -> str | None:
    """The fabric domain of one GPU, probed once per process; None (logged) when there is none."""
    try:
        import pynvml  # noqa: F401  (only to tell "not installed" apart without a subprocess)
    except ImportError as exc:
        log.info("nvlink_domain: nvidia-ml-py is not importable (%s); using the host name", exc)
        return None
    domain, reason = _run_probe(gpu_uuid)
    if domain is None:
        log.info("nvlink_domain: no NVLink fabric (%s); using the host name", reason)
        log.debug("nvlink_domain: probed %s", gpu_uuid)
    return domain


def _gpu_uuid(device: torch.device | int | str | None) -> str | None:
    """NVML's name of the CUDA device ("GPU-<uuid>"), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    dev = torch.device(dev) if not isinstance(dev, torch.device) else dev
    if dev.type != "cuda":
        raise ValueError(f"device: expected a CUDA device or None, got {device!r}")
    props = torch.cuda.get_device_properties(dev)
    uuid = getattr(props, "uuid", None)
    return None if uuid is None else f"GPU-{uuid}"


def nvlink_domain(device: torch.device | int | str | None = None) -> str:
    """Identify the NVLink domain of a GPU (default: the current CUDA device).

    On GPUs attached to an NVLink fabric (GB200/GB300 NVL72 racks) this is the fabric cluster UUID
    and clique reported by NVML (needs nvidia-ml-py). Otherwise it is the host name, which assumes
    the GPUs of one host are NVLink peers: true on HGX/DGX-style systems, not on PCIe-only boxes.
    Without CUDA it is the host name too. NVML problems never raise; they are logged.

    Args:
        device: a CUDA device; None means the current one.

    Returns:
        `"nvlink-fabric:<cluster uuid hex>:<clique id>"` or the host name.
    """
    gpu_uuid = _gpu_uuid(device)
    fabric = _fabric_domain(gpu_uuid) if gpu_uuid is not None else None
    return fabric if fabric is not None else _host_domain()


def in_one_nvlink_domain(group: dist.ProcessGroup | None = None) -> bool:
    """True when every rank of `group` shares one NVLink domain, so copy-engine transfers work.

    Collective: every rank of `group` must call it (an `all_gather_object` of `nvlink_domain()`).

    Args:
        group: the process group; None means the default group.

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError("in_one_nvlink_domain needs an initialised torch.distributed group")
    domains: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(domains, nvlink_domain(), group=group)
    if len(set(domains)) > 1:
        log.info("ranks span several NVLink domains: %s", sorted(set(map(str, domains))))
    return len(set(domains)) == 1
