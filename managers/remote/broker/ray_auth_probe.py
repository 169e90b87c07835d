"""Whether a Ray cluster enforces token authentication (issue 35): the broker's own token proves nothing, since a
cluster started without ``RAY_AUTH_MODE=token`` accepts any token. So the cluster is asked once with a random wrong
token, and must refuse.

Ray loads the token and the mode once per process, so the question is asked from a fresh process: this module run
as ``python -m managers.remote.broker.ray_auth_probe GCS_ADDRESS``, which reads one key from the GCS with Ray's own GCS
client (one round trip; about 1 s in all, most of it importing Ray). It exits 0 when the GCS refused the token, 1 when
it answered, and with a traceback on anything else.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

#: the probe's exit status when the cluster refused the wrong token, and when it answered anyway
REFUSED, ANSWERED = 0, 1
#: how long the probe's one call may take, and the whole probe (a fresh Python importing Ray)
CALL_TIMEOUT_S = 10
PROBE_TIMEOUT_S = 60


def enforcement_problem(gcs_address: str) -> str | None:
    """Why the cluster whose GCS listens at ``gcs_address`` is not shown to enforce token authentication; None when
    it refused a random wrong token."""
    environ = {key: value for key, value in os.environ.items() if key != "RAY_AUTH_TOKEN_PATH"}
    environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    try:
        probe = subprocess.run([sys.executable, "-m", __name__, gcs_address], env=environ, capture_output=True,
                               text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"a call with a wrong token got no answer within {PROBE_TIMEOUT_S} s"
    if probe.returncode == REFUSED:
        return None
    if probe.returncode == ANSWERED:
        return "it answered a call with a wrong token"
    return f"a call with a wrong token failed otherwise: {probe.stderr.strip()[-500:]}"


def ask_with_a_wrong_token(gcs_address: str) -> int:
    """In the probe's process (its environment holds the wrong token): ``REFUSED`` or ``ANSWERED``."""
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # no stub for it
    from ray.exceptions import AuthenticationError

    try:
        GcsClient(address=gcs_address).internal_kv_get(b"tangram-auth-probe", None, timeout=CALL_TIMEOUT_S)
    except AuthenticationError:
        return REFUSED
    return ANSWERED


if __name__ == "__main__":
    sys.exit(ask_with_a_wrong_token(sys.argv[1]))
