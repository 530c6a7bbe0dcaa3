"""What the seeded fuzzers of tests/test_fuzz_*.py end in, counted by outcome (the figures in RELIABILITY.md).
CPU only; the download schedules run against tests/hub_server.py on 127.0.0.1.

    python bench/fuzz_tally.py templates --seeds 60     # mutated real chat templates
    python bench/fuzz_tally.py store --seeds 1000       # byte-corrupted chat stores
    python bench/fuzz_tally.py hub --seeds 60           # random server fault schedules
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import tempfile
import time
import warnings
from pathlib import Path


def tally_templates(seeds: int) -> collections.Counter:
    from engine.chat import ChatTemplate, ChatTemplateError
    from tests.test_fuzz_chat_template import MESSAGES, TIMEOUT_S, WHERE, mutate, real_templates

    counts: collections.Counter = collections.Counter()
    for seed in range(seeds):
        rng = random.Random(seed)
        for source in real_templates():
            try:
                ChatTemplate(mutate(source, rng), WHERE).render(MESSAGES, timeout_s=TIMEOUT_S, bos_token="<s>")
                counts["rendered"] += 1
            except ChatTemplateError as e:
                counts[re.sub(r"[\d,.]+", "N", str(e)[len(WHERE) + 2:])[:60]] += 1
    return counts


def tally_store(seeds: int) -> collections.Counter:
    import app.store
    import tests.test_fuzz_store as fuzz

    counts: collections.Counter = collections.Counter()
    real = app.store.open_store

    def counted(path, **kwargs):
        store = real(path, **kwargs)
        counts["moved aside" if store.recovered else "repaired" if store.repairs else
               "in memory" if store.temporary else "opened clean"] += 1
        return store

    fuzz.open_store = counted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in range(seeds):
            fuzz.check_byte_damage(Path(tempfile.mkdtemp(prefix="zerotvm-tally-")), seed)
    return counts


def tally_hub(seeds: int) -> collections.Counter:
    from huggingface_hub import constants
    from huggingface_hub.utils import close_session

    import tests.test_fuzz_hub as fuzz
    from engine.hub import download
    from tests.helpers import HUB_FILES as FILES
    from tests.helpers import HUB_REPO as REPO
    from tests.helpers import no_connections
    from tests.hub_server import HubServer

    download.BACKOFF_BASE_S, download.FILE_TIME_FLOOR_S, download.READ_TIMEOUT_S = 0.01, 10.0, 5.0
    os.environ["HF_HUB_DISABLE_XET"] = "1"
    constants.HF_HUB_DISABLE_XET = True
    counts: collections.Counter = collections.Counter()
    with no_connections(allow_loopback=True):
        for seed in range(seeds):
            server = HubServer().start()
            server.add_repo(REPO, FILES)
            os.environ["HF_ENDPOINT"] = constants.ENDPOINT = server.endpoint
            close_session()
            rng = random.Random(seed)
            fuzz.random_schedule(server, rng)
            dest = Path(tempfile.mkdtemp(prefix="zerotvm-tally-")) / "m"
            try:
                download.download_model(REPO, dest=dest, retries=rng.randint(0, 3))
                counts["installed"] += 1
            except download.DownloadError as e:
                text = re.sub(r"127\.0\.0\.1:\d+", "HOST", str(e))
                counts["refused: " + re.sub(r"\d[\d,.]*", "N", text)[:70]] += 1
            finally:
                server.stop()
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["templates", "store", "hub"])
    p.add_argument("--seeds", type=int, default=60)
    args = p.parse_args()
    t0 = time.monotonic()
    counts = {"templates": tally_templates, "store": tally_store, "hub": tally_hub}[args.what](args.seeds)
    for outcome, n in counts.most_common():
        print(f"{n:6d}  {outcome}")
    print(f"{sum(counts.values())} cases in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
