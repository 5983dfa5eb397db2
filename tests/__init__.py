"""Shared test helpers."""


def rss_bytes(pid="self"):
    """Resident memory of process `pid` (this one by default), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")
