"""CPU-s of transformers' GGUF weight map (``get_gguf_hf_weights_map``) on SmolLM2-135M's and Gemma 3 270M's
modules (built on the meta device), plain and under fedllm's ``gguf_cache.tensor_name_maps_once``, interleaved.

    python bench/gguf_name_map.py
"""
import time, torch, transformers
from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map
from fedllm.models import gguf_cache
from fedllm.models.info import transformers_config
from fedllm.recipe.schema import ModelConfig
for name in ("smollm2-135m-instruct", "gemma3-270m"):
    try:
        cfg = transformers_config(ModelConfig(name=name))
    except Exception as e:
        print(name, "skipped", e); continue
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    for trial in range(2):
        for kind in ("plain", "once"):
            t = time.process_time()
            if kind == "once":
                with gguf_cache.tensor_name_maps_once():
                    get_gguf_hf_weights_map(model, TensorProcessor())
            else:
                get_gguf_hf_weights_map(model, TensorProcessor())
            print(name, trial, kind, round(time.process_time() - t, 2), "CPU-s", flush=True)
