use tch::nn::OptimizerConfig;
use tch::{Device, Kind, Tensor, nn};

use super::*;

/// Two identical VarStores with a couple of parameters, and a loss over them.
fn store(seed: i64) -> nn::VarStore {
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let _ = (&root / "a").randn("weight", &[7, 5], 0.0, 1.0);
    let _ = (&root / "b").randn("weight", &[3], 0.0, 1.0);
    vs
}

fn loss(vs: &nn::VarStore, step: i64) -> Tensor {
    let vars = vs.variables();
    let a = &vars["a.weight"];
    let b = &vars["b.weight"];
    (a * (step as f64 + 1.0)).sin().sum(Kind::Float) + (b * b).sum(Kind::Float) * 3.0
}

#[test]
fn flat_adamw_matches_torch_adamw() {
    let cfg = AdamWConfig {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let ours = store(3);
    let theirs = store(3);
    let mut opt = AdamW::new(&ours, cfg, Kind::Float).expect("flat AdamW");
    let mut reference = nn::AdamW {
        beta1: 0.9,
        beta2: 0.999,
        wd: 0.01,
        eps: 1e-8,
        amsgrad: false,
    }
    .build(&theirs, 1e-2)
    .expect("torch AdamW");
    for step in 0..6 {
        opt.zero_grad();
        loss(&ours, step).backward();
        opt.step(1e-2, 1.0).expect("step");
        reference.zero_grad();
        loss(&theirs, step).backward();
        reference.step();
    }
    let (o, t) = (ours.variables(), theirs.variables());
    for name in ["a.weight", "b.weight"] {
        let diff = (&o[name] - &t[name]).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{name}: max |diff| {diff}");
    }
}

#[test]
fn gradients_accumulate_in_the_flat_buffer_and_zero_in_place() {
    let vs = store(1);
    let mut opt = AdamW::new(
        &vs,
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        },
        Kind::Float,
    )
    .expect("flat AdamW");
    loss(&vs, 0).backward();
    let one = opt.grad_norm().expect("norm");
    loss(&vs, 0).backward();
    let two = opt.grad_norm().expect("norm");
    assert!((two - 2.0 * one).abs() < 1e-4 * one, "{one} then {two}");
    opt.zero_grad();
    assert_eq!(opt.grad_norm().expect("norm"), 0.0);
    loss(&vs, 0).backward();
    assert!((opt.grad_norm().expect("norm") - one).abs() < 1e-4 * one);
}

#[test]
fn bias_and_layer_norm_get_no_weight_decay() {
    assert!(decays("bert.encoder.layer.0.attention.self.query.weight"));
    assert!(!decays("bert.encoder.layer.0.attention.self.query.bias"));
    assert!(!decays("bert.embeddings.LayerNorm.weight"));
    assert!(!decays(
        "distilbert.transformer.layer.0.sa_layer_norm.weight"
    ));
}

#[test]
fn schedules_warm_up_then_follow_their_shape() {
    let lr = |s, step| learning_rate(s, 1.0, 10, step, 110);
    assert_eq!(lr(Schedule::Linear, 0), 0.0);
    assert!((lr(Schedule::Linear, 5) - 0.5).abs() < 1e-12);
    assert!((lr(Schedule::Linear, 10) - 1.0).abs() < 1e-12);
    assert!((lr(Schedule::Linear, 60) - 0.5).abs() < 1e-12);
    assert!((lr(Schedule::Cosine, 60) - 0.5).abs() < 1e-12);
    assert!(lr(Schedule::Cosine, 110).abs() < 1e-12);
    assert_eq!(lr(Schedule::Constant, 100), 1.0);
}
