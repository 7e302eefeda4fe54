use tch::nn::OptimizerConfig;
use tch::{Device, Kind, Tensor, nn};

use super::*;

/// A VarStore with a couple of parameters whose values depend only on `seed` (not on the
/// global RNG, which tests running in parallel share), and a loss over them.
fn store(seed: u64) -> nn::VarStore {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u64 + 1) * 2_654_435_761 + seed) % 1000) as f32 / 250.0 - 2.0)
            .collect()
    };
    let init = |path: nn::Path, shape: &[i64]| {
        let n = shape.iter().product::<i64>() as usize;
        let mut var = path.zeros("weight", shape);
        tch::no_grad(|| var.copy_(&Tensor::from_slice(&values(n)).view(shape)));
    };
    init(&root / "a", &[7, 5]);
    init(&root / "b", &[3]);
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

/// The third step at lr 1e-3, gradients halved (clipping), the first 60,000 elements decayed.
fn step_of(c: AdamWConfig) -> Step {
    Step {
        lr: 1e-3,
        grad_scale: 0.5,
        decayed: 60_000,
        c,
        bc1: 1.0 - c.beta1.powi(3),
        bc2: 1.0 - c.beta2.powi(3),
    }
}

/// Random fp32 weights and both moments (the second non-negative) of `n` parameters.
fn optimizer_state(n: i64) -> (Tensor, Tensor, Tensor) {
    let p = Tensor::randn([n], (Kind::Float, Device::Cpu));
    let m = Tensor::randn([n], (Kind::Float, Device::Cpu)) * 0.1;
    let v = Tensor::rand([n], (Kind::Float, Device::Cpu)) * 0.01;
    (p, m, v)
}

/// The device path (tensor ops, used on CUDA) and the fused CPU loop do the same arithmetic.
#[test]
fn tensor_op_path_matches_the_fused_cpu_path() {
    tch::manual_seed(5);
    let n = 100_003;
    let cfg = AdamWConfig {
        beta1: 0.9,
        beta2: 0.98,
        eps: 1e-6,
        weight_decay: 0.1,
    };
    let (p1, m1, v1) = optimizer_state(n);
    let (p2, m2, v2) = (p1.copy(), m1.copy(), v1.copy());
    let g = Tensor::randn([n], (Kind::Float, Device::Cpu));
    let step = step_of(cfg);
    fused_cpu(&p1, &g, &m1, &v1, None, &step);
    tensor_ops(&p2, &g, &m2, &v2, &step);
    for (a, b, what) in [
        (&p1, &p2, "weights"),
        (&m1, &m2, "exp_avg"),
        (&v1, &v2, "exp_avg_sq"),
    ] {
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{what}: max |diff| {diff}");
    }
}

/// A bf16 model's step reads its bf16 gradients and writes its bf16 weights in the same pass:
/// the fp32 masters and moments come out exactly as from the same gradients in fp32, and the
/// weights are the masters rounded to bf16 (to nearest, as `to_kind` rounds).
#[test]
fn a_bf16_step_updates_the_masters_as_fp32_and_writes_rounded_weights() {
    tch::manual_seed(6);
    let n = 200_001;
    let cfg = AdamWConfig {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let (p, m, v) = optimizer_state(n);
    let g16 = Tensor::randn([n], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16);
    let (p1, m1, v1) = (p.copy(), m.copy(), v.copy());
    let (p2, m2, v2) = (p.copy(), m.copy(), v.copy());
    let weights = Tensor::zeros([n], (Kind::BFloat16, Device::Cpu));
    let step = step_of(cfg);
    fused_cpu(&p1, &g16, &m1, &v1, Some(&weights), &step);
    fused_cpu(&p2, &g16.to_kind(Kind::Float), &m2, &v2, None, &step);
    for (a, b, what) in [
        (&p1, &p2, "weights"),
        (&m1, &m2, "exp_avg"),
        (&v1, &v2, "exp_avg_sq"),
    ] {
        assert!(a.equal(b), "{what} differ between bf16 and fp32 gradients");
    }
    assert!(p1.to_kind(Kind::BFloat16).equal(&weights), "bf16 weights");
    assert!(!p1.equal(&p), "the step changed nothing");
}

/// The gradient norm's own pass gives the fp64 norm of the gradients, fp32 or bf16.
#[test]
fn the_gradient_norm_is_the_fp64_norm_of_either_kind() {
    tch::manual_seed(7);
    let g = Tensor::randn([300_007], (Kind::Float, Device::Cpu)) * 3.0;
    for g in [g.shallow_clone(), g.to_kind(Kind::BFloat16)] {
        let want = g
            .to_kind(Kind::Double)
            .square()
            .sum(Kind::Double)
            .double_value(&[]);
        let got = sum_of_squares_cpu(&g);
        assert!(
            (got - want).abs() <= 1e-12 * want,
            "{:?}: {got} vs {want}",
            g.kind()
        );
    }
    assert_eq!(
        sum_of_squares_cpu(&Tensor::zeros([5], (Kind::Float, Device::Cpu))),
        0.0
    );
}

/// Two ranks (threads joined over 127.0.0.1 through libtorch's c10d) whose batches look up
/// different embedding rows: reducing the looked-up rows only gives every rank the dense
/// average of the whole gradient buffer, bit for bit.
#[test]
fn looked_up_rows_reduce_to_the_dense_average() {
    use crate::train::{Group, Launch};
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let spawn_rank = move |rank: usize, ids: Vec<i64>| {
        std::thread::spawn(move || {
            let launch = Launch {
                rank,
                world: 2,
                local_rank: rank,
                local_world: 2,
                master_addr: "127.0.0.1".into(),
                master_port: port,
                agent_store: false,
                attempt: 0,
            };
            let group =
                Group::join(&launch, std::time::Duration::from_secs(30), false).expect("join");
            let vs = nn::VarStore::new(Device::Cpu);
            let root = vs.root();
            let embeddings = &root / "embeddings" / "word_embeddings";
            let table: Vec<f32> = (0..40).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut e = embeddings.zeros("weight", &[10, 4]);
            tch::no_grad(|| e.copy_(&Tensor::from_slice(&table).view([10, 4])));
            let mut w = (&root / "dense").zeros("weight", &[4, 3]);
            tch::no_grad(|| w.copy_(&Tensor::from_slice(&table[..12]).view([4, 3])));
            let _ = (&root / "dense").zeros("bias", &[3]);
            let cfg = AdamWConfig {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
            };
            let mut opt = AdamW::new(&vs, cfg, Kind::Float).expect("optimizer");
            let vars = vs.variables();
            let ids = Tensor::from_slice(&ids);
            let hidden = vars["embeddings.word_embeddings.weight"].index_select(0, &ids);
            let out = hidden.matmul(&vars["dense.weight"]) + &vars["dense.bias"];
            (out.pow_tensor_scalar(2).sum(Kind::Float) * (rank as f64 + 1.0)).backward();
            opt.bind_grads().expect("bind");
            let local = opt.flat_grad.copy();
            let mut looked_up = opt
                .looked_up("embeddings.word_embeddings.weight")
                .expect("the embedding matrix");
            assert_eq!(
                (looked_up.offset, looked_up.rows, looked_up.width),
                (12, 10, 4)
            );
            looked_up.mark(&ids);
            let floats = opt
                .reduce_grads(Some(&mut looked_up), |t| {
                    group.all_reduce_mean(t, "the test's gradients")
                })
                .expect("reduce");
            (local, opt.flat_grad.copy(), floats)
        })
    };
    let zero = spawn_rank(0, vec![1, 2, 2]);
    let one = spawn_rank(1, vec![2, 7]);
    let (l0, g0, n0) = zero.join().expect("rank 0");
    let (l1, g1, n1) = one.join().expect("rank 1");
    let dense = (&l0 + &l1) / 2.0;
    for (r, got) in [(0, &g0), (1, &g1)] {
        let diff = (got - &dense).abs().max().double_value(&[]);
        assert_eq!(diff, 0.0, "rank {r}: {got:?} against {dense:?}");
    }
    // Rows 1, 2 and 7 of the 10 went, with the 12 + 3 dense floats and the 10 flags.
    assert_eq!((n0, n1), (12 + 3 * 4 + 3 + 10, 12 + 3 * 4 + 3 + 10));
}
