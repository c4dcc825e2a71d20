"""Imported at start-up by a Python process whose path holds this folder: the follower ranks of the TP test that
checks for host-device syncs (rank 0 puts the folder first on its path, which its followers inherit).

With LORAPLEX_TEST_SYNC_DEBUG_DIR set, SIGUSR2 sets torch's CUDA sync debug mode to "error" in the process, which
then writes "ok" (or the error) to the file named by its process id in that folder: rank 0 signals its followers
once their warm-up steps are done, and waits for the files.
"""
import os
import signal


def _error_on_sync(signum, frame) -> None:
    try:
        import torch
        torch.cuda.set_sync_debug_mode("error")
        result = "ok"
    except Exception as e:                  # told to rank 0 through the file, not raised in the follower's step
        result = f"{type(e).__name__}: {e}"
    path = os.path.join(os.environ["LORAPLEX_TEST_SYNC_DEBUG_DIR"], str(os.getpid()))
    with open(path + ".part", "w") as f:
        f.write(result)
    os.replace(path + ".part", path)        # whole when it appears


if "LORAPLEX_TEST_SYNC_DEBUG_DIR" in os.environ:
    signal.signal(signal.SIGUSR2, _error_on_sync)
