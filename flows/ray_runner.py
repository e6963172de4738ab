"""Prefect's Ray task runner, connected to an existing cluster the way the audit's checks connect.

prefect-ray's runner calls ``ray.init`` once; Ray's client server sometimes fails to start the server it forks
for a client (ConnectionAbortedError; the next client is served), which failed a whole audit in CI. Connected
first with ``connect_ray``'s retries, the runner finds Ray initialized and uses that connection; this runner
then closes it.
"""

from __future__ import annotations

import ray
from prefect_ray import RayTaskRunner

from tasks.audit.cluster import connect_ray


class ConnectedRayTaskRunner(RayTaskRunner):
    def __enter__(self):
        connect_ray(self.address, **self.init_kwargs)
        try:
            return super().__enter__()
        except BaseException:
            ray.shutdown()
            raise

    def __exit__(self, *exc_info):
        try:
            super().__exit__(*exc_info)
        finally:
            ray.shutdown()
