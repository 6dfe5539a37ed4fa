"""Run autofaiss.build_index in the bench virtualenv (.venv-bench); print its infos and wall time as JSON.

    .venv-bench/bin/python bench/autofaiss_child.py EMBEDDINGS_DIR OUT_DIR MEMORY
"""

import json
import sys
import time

from autofaiss import build_index

embeddings, out, memory = sys.argv[1:4]
t0 = time.perf_counter()
_, infos = build_index(embeddings=embeddings, index_path=f"{out}/autofaiss.index",
                       index_infos_path=f"{out}/infos.json", max_index_memory_usage=memory,
                       current_memory_available="16G", metric_type="ip", nb_cores=2, save_on_disk=True,
                       verbose=30)
print("RESULT " + json.dumps({"seconds": round(time.perf_counter() - t0, 2), "infos": infos}))
