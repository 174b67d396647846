import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

# Small ops get much slower when threads are oversubscribed: use exactly what the machine has.
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
