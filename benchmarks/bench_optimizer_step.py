"""Optimizer step time and per-rank optimizer memory at stage 2, world 2: AdamW vs Adafactor and
Muon with auxiliary AdamW (the config's "optimizer": {"type": "Muon"}), both whole-parameter steps."""
import sys, time, json, torch
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))))
from tests.distributed.launch import run_distributed

def run(kind):
    import hf_zero
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=1000, n_positions=64))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}}
    if kind == "muon":
        cfg["optimizer"] = {"type": "Muon", "params": {"lr": 2e-2, "adam_lr": 1e-3}}
        opt = None
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if kind == "adamw" else torch.optim.Adafactor(model.parameters(), lr=1e-3)
    engine, zo, _, _ = hf_zero.initialize(model=model, config=cfg, optimizer=opt)
    times = []
    for step in range(6):
        ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        t = time.perf_counter(); engine.step(); times.append(time.perf_counter() - t)
    state = sum(v.numel() * v.element_size() for s in zo.state.values() for v in s.values() if torch.is_tensor(v))
    masters = sum(p.numel() * 4 for g in zo.param_groups for p in g["params"]) if kind != "adamw" else 0
    return {"step_ms_median": sorted(times[1:])[len(times[1:]) // 2] * 1e3, "optimizer_state_mb": state / 2**20,
            "owner_masters_mb": masters / 2**20, "params_m": sum(p.numel() for p in model.parameters()) / 1e6}

if __name__ == "__main__":
    for kind in ("adamw", "adafactor", "muon"):
        print(kind, [json.dumps({k: round(v, 3) for k, v in r.items()}) for r in run_distributed(run, 2, kind)])
