"""Is the Hugging Face hub reachable? Asked once per process, answered in seconds.

Without a network, ``huggingface_hub`` retries every request with backoff (about a minute per file) before
``transformers`` or ``datasets`` fall back to the local cache or fail. The harness asks once, before it
resolves a hub model or hub data (:mod:`evaluation.inputs`): one ``HEAD`` request to the hub endpoint
(``HF_ENDPOINT``, proxies from the environment) with a :data:`HUB_CHECK_TIMEOUT_S` timeout, in a thread so that
a hanging DNS lookup is bounded too. When the hub is unreachable the process switches to offline mode, as if
``HF_HUB_OFFLINE=1`` had been set before start: every later hub call reads the local cache only and fails at
once when a file is missing. ``HF_HUB_OFFLINE=1`` skips the check.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import urllib.error
import urllib.request

logger = logging.getLogger("evaluation.hub")

__all__ = ["HUB_CHECK_TIMEOUT_S", "hub_reachable", "is_offline", "go_offline"]

#: Seconds the reachability check waits for the hub's answer (DNS lookup and connection included).
HUB_CHECK_TIMEOUT_S = 3.0

_REACHABLE: dict[str, bool] = {}  # endpoint -> answer, once per process


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def is_offline() -> bool:
    """True when ``huggingface_hub`` is in offline mode (``HF_HUB_OFFLINE=1`` or :func:`go_offline`)."""
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def _probe(url: str, timeout: float, answer: list) -> None:
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
        answer.append(True)
    except urllib.error.HTTPError:  # the hub answered (4xx/5xx): it is reachable
        answer.append(True)
    except Exception:  # DNS, connection, TLS, timeout: unreachable
        answer.append(False)


def hub_reachable(timeout: float = HUB_CHECK_TIMEOUT_S) -> bool:
    """Whether the hub endpoint answers within ``timeout`` seconds (False at once in offline mode).

    The answer is memoised per endpoint for the process; an unreachable hub switches the process to offline
    mode (:func:`go_offline`) and logs one warning.
    """
    if is_offline():
        return False
    url = _endpoint()
    if url not in _REACHABLE:
        answer: list[bool] = []
        probe = threading.Thread(target=_probe, args=(url, timeout, answer), daemon=True)
        probe.start()
        probe.join(timeout + 0.5)  # a DNS lookup ignores the socket timeout: bound it here
        _REACHABLE[url] = bool(answer and answer[0])
        if not _REACHABLE[url]:
            logger.warning(
                "the Hugging Face hub (%s) is unreachable (no answer within %g s): running offline, from "
                "the local cache only",
                url,
                timeout,
            )
            go_offline()
    return _REACHABLE[url]


def go_offline() -> None:
    """Put ``huggingface_hub`` (hence ``transformers``) and ``datasets`` in offline mode for this process and
    its children, as ``HF_HUB_OFFLINE=1`` at start would."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    config = sys.modules.get("datasets.config")  # imported later, it reads the environment variable
    if config is not None:
        config.HF_HUB_OFFLINE = True
