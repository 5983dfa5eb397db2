"""Runs one function per worker in threads, for in-process cluster tests."""

import threading


def run_worker_threads(num_workers, body, timeout=60):
    """Calls `body(w)` for every worker w in its own thread and waits.

    Args:
        num_workers: how many workers (threads).
        body: `body(w)` returning that worker's result.
        timeout: seconds each thread is waited for. Defaults to 60.

    Returns:
        ({w: result}, [exceptions raised by any body]).
    """
    results, errors = {}, []

    def run(w):
        try:
            results[w] = body(w)
        except BaseException as exc:  # handed back to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,))
               for w in range(num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results, errors


def run_clients(cluster, body, kwargs_of=None, **client_kwargs):
    """Runs `body(client, w)` with a client of `cluster` per worker thread.

    Args:
        cluster: a `LocalCluster`.
        body: `body(client, w)` returning that worker's result.
        kwargs_of: optional `kwargs_of(w)`: extra client arguments of
            worker w. Defaults to None.
        **client_kwargs: client arguments of every worker.

    Returns:
        {w: result}; the first exception any body raised is raised here.
    """
    def run(w):
        extra = kwargs_of(w) if kwargs_of else {}
        with cluster.client(w, **client_kwargs, **extra) as client:
            return body(client, w)

    results, errors = run_worker_threads(cluster.num_workers, run)
    if errors:
        raise errors[0]
    return results
