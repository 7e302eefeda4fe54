//! Classification metrics, as scikit-learn defines them (zero where undefined).

use std::collections::BTreeMap;

/// The metrics of one evaluation, by name (`loss`, `accuracy`, `f1_macro`, ...).
pub(crate) type Metrics = BTreeMap<String, f64>;

/// Names `early_stopping.metric` and `best_metric` may use.
pub(crate) const NAMES: &[&str] = &[
    "loss",
    "accuracy",
    "precision_macro",
    "recall_macro",
    "f1_macro",
    "precision_weighted",
    "recall_weighted",
    "f1_weighted",
];

/// Whether a larger value of `metric` is better.
pub(crate) fn higher_is_better(metric: &str) -> bool {
    metric != "loss"
}

/// Metrics of `predicted` against `actual` (class ids below `classes`), with mean `loss`.
pub(crate) fn classification(
    actual: &[i64],
    predicted: &[i64],
    classes: usize,
    loss: f64,
) -> Metrics {
    let mut tp = vec![0f64; classes];
    let mut fp = vec![0f64; classes];
    let mut support = vec![0f64; classes];
    for (&a, &p) in actual.iter().zip(predicted) {
        let (a, p) = (a as usize, p as usize);
        support[a] += 1.0;
        if a == p {
            tp[a] += 1.0;
        } else {
            fp[p] += 1.0;
        }
    }
    let ratio = |n: f64, d: f64| if d > 0.0 { n / d } else { 0.0 };
    let precision: Vec<f64> = (0..classes).map(|c| ratio(tp[c], tp[c] + fp[c])).collect();
    let recall: Vec<f64> = (0..classes).map(|c| ratio(tp[c], support[c])).collect();
    let f1: Vec<f64> = (0..classes)
        .map(|c| ratio(2.0 * precision[c] * recall[c], precision[c] + recall[c]))
        .collect();
    let n = actual.len() as f64;
    let macro_avg = |v: &[f64]| v.iter().sum::<f64>() / classes as f64;
    let weighted = |v: &[f64]| ratio(v.iter().zip(&support).map(|(x, s)| x * s).sum(), n);
    let mut m = Metrics::new();
    m.insert("loss".into(), loss);
    m.insert("accuracy".into(), ratio(tp.iter().sum(), n));
    m.insert("precision_macro".into(), macro_avg(&precision));
    m.insert("recall_macro".into(), macro_avg(&recall));
    m.insert("f1_macro".into(), macro_avg(&f1));
    m.insert("precision_weighted".into(), weighted(&precision));
    m.insert("recall_weighted".into(), weighted(&recall));
    m.insert("f1_weighted".into(), weighted(&f1));
    m
}

#[cfg(test)]
mod tests {
    use super::classification;

    #[test]
    fn matches_scikit_learn_on_a_worked_example() {
        // sklearn.metrics on y_true=[0,0,0,1,1,2], y_pred=[0,1,0,1,2,2]:
        // precision per class [1, .5, .5], recall [2/3, .5, 1], f1 [.8, .5, 2/3].
        let m = classification(&[0, 0, 0, 1, 1, 2], &[0, 1, 0, 1, 2, 2], 3, 0.25);
        let close = |k: &str, v: f64| assert!((m[k] - v).abs() < 1e-12, "{k}: {} vs {v}", m[k]);
        close("accuracy", 4.0 / 6.0);
        close("precision_macro", 2.0 / 3.0);
        close("recall_macro", (2.0 / 3.0 + 0.5 + 1.0) / 3.0);
        close("f1_macro", (0.8 + 0.5 + 2.0 / 3.0) / 3.0);
        close("precision_weighted", (3.0 * 1.0 + 2.0 * 0.5 + 0.5) / 6.0);
        close("f1_weighted", (3.0 * 0.8 + 2.0 * 0.5 + 2.0 / 3.0) / 6.0);
        close("loss", 0.25);
    }

    #[test]
    fn a_class_never_predicted_counts_zero_not_nan() {
        let m = classification(&[0, 1], &[0, 0], 2, 0.0);
        assert!(m.values().all(|v| v.is_finite()));
        assert_eq!(m["precision_macro"], 0.25);
    }
}
