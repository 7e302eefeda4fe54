//! The SQL functions of served models, as DataFusion async scalar UDFs: `predict(text)` (the
//! label), `predict_score(text)` (its probability), `predict_proba(text)` (every class's, in
//! `id2label` order), `embed(text)` (the sentence vector), and the same under each model's
//! own name (`<model>_embed`). The predict functions take an optional second argument, the
//! text pair. A model without a classification head has `embed` only.
//!
//! DataFusion runs async functions in projections and filters only. [`lift_async_calls`]
//! moves calls out of `GROUP BY` and `ORDER BY` into a projection below them, and
//! [`check_async_placement`] refuses the rest (a join condition, a window) with a rewrite
//! the user can apply.

use std::collections::BTreeSet;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use arrow::array::{ArrayRef, Float32Array, StringArray};
use arrow::datatypes::DataType;
use datafusion::common::plan_err;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::async_udf::{AsyncScalarUDF, AsyncScalarUDFImpl};
use datafusion::logical_expr::{Aggregate, col};
use datafusion::logical_expr::{
    ColumnarValue, Expr, LogicalPlan, Projection, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl,
    Signature, Sort, TypeSignature, Volatility,
};
use datafusion::sql::sqlparser::dialect::GenericDialect;
use datafusion::sql::sqlparser::tokenizer::{Token, Tokenizer};
use tonic::async_trait;

use super::scorer::Scorer;
use crate::predict::{float_list, float_rows};

/// Rows handed to the model per call (the engine merges concurrent calls).
const BATCH_ROWS: usize = 2048;

/// What a function returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Output {
    Label,
    Score,
    Proba,
    Embed,
}

impl Output {
    const ALL: [Output; 4] = [Output::Label, Output::Score, Output::Proba, Output::Embed];

    /// The function's name for a model's `prefix` (`predict` for the default model, whose
    /// vector function is plain `embed`).
    fn name(self, prefix: &str) -> String {
        match self {
            Output::Label => prefix.to_string(),
            Output::Score => format!("{prefix}_score"),
            Output::Proba => format!("{prefix}_proba"),
            Output::Embed if prefix == "predict" => "embed".into(),
            Output::Embed => format!("{prefix}_embed"),
        }
    }
}

/// One SQL function of one model.
#[derive(Debug)]
struct ModelFunction {
    name: String,
    output: Output,
    scorer: Arc<Scorer>,
    signature: Signature,
}

impl PartialEq for ModelFunction {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && Arc::ptr_eq(&self.scorer, &other.scorer)
    }
}
impl Eq for ModelFunction {}
impl Hash for ModelFunction {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.name.hash(state);
    }
}

impl ScalarUDFImpl for ModelFunction {
    fn name(&self) -> &str {
        &self.name
    }
    fn signature(&self) -> &Signature {
        &self.signature
    }
    fn return_type(&self, _args: &[DataType]) -> Result<DataType> {
        Ok(match self.output {
            Output::Label => DataType::Utf8,
            Output::Score => DataType::Float32,
            Output::Proba | Output::Embed => float_list(),
        })
    }
    fn invoke_with_args(&self, _args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        // DataFusion calls the async path; reaching this is a planner gap, explained here.
        plan_err!("{}", placement_hint(&self.name))
    }
}

#[async_trait]
impl AsyncScalarUDFImpl for ModelFunction {
    fn ideal_batch_size(&self) -> Option<usize> {
        Some(BATCH_ROWS)
    }

    async fn invoke_async_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let rows = args.number_rows;
        let arrays = args
            .args
            .iter()
            .map(|a| a.to_array(rows))
            .collect::<Result<Vec<_>>>()?;
        let (texts, pairs) = match arrays.as_slice() {
            [t] => (t, None),
            [t, p] => (t, Some(p)),
            _ => return plan_err!("{}() takes a text, or a text and its pair", self.name),
        };
        let failed = |e| DataFusionError::External(Box::new(e));
        let array: ArrayRef = if self.output == Output::Embed {
            if pairs.is_some() {
                return plan_err!("{}() takes one text", self.name);
            }
            let v = self.scorer.embed(texts).await.map_err(failed)?;
            Arc::new(float_rows(v.values, v.dims, v.nulls))
        } else {
            let scores = self.scorer.score(texts, pairs).await.map_err(failed)?;
            let nulls = scores.nulls.clone();
            match self.output {
                Output::Label => {
                    let (ids, _) = scores.best();
                    let labels = &self.scorer.labels;
                    Arc::new(StringArray::from_iter((0..rows).map(|r| {
                        nulls
                            .as_ref()
                            .is_none_or(|n| n.is_valid(r))
                            .then(|| labels[ids[r] as usize].as_str())
                    })))
                }
                Output::Score => {
                    let (_, best) = scores.best();
                    Arc::new(Float32Array::new(best.into(), nulls))
                }
                Output::Proba | Output::Embed => {
                    Arc::new(float_rows(scores.probabilities, scores.classes, nulls))
                }
            }
        };
        Ok(ColumnarValue::Array(array))
    }
}

/// The functions of a model under `prefix` (its own name, or `predict` for the default).
pub(crate) fn functions(prefix: &str, scorer: &Arc<Scorer>) -> Vec<ScalarUDF> {
    Output::ALL
        .into_iter()
        .filter(|o| *o == Output::Embed || !scorer.labels.is_empty())
        .map(|output| {
            let f = ModelFunction {
                name: output.name(prefix),
                output,
                scorer: scorer.clone(),
                // Volatile: never folded into a constant at planning time (the model runs only
                // in the async path) and never pushed into a table scan.
                signature: Signature::one_of(
                    vec![TypeSignature::String(1), TypeSignature::String(2)],
                    Volatility::Volatile,
                ),
            };
            AsyncScalarUDF::new(Arc::new(f)).into_scalar_udf()
        })
        .collect()
}

/// The names the functions of a model under `prefix` may have.
pub(crate) fn function_names(prefix: &str) -> impl Iterator<Item = String> + '_ {
    Output::ALL.into_iter().map(move |o| o.name(prefix))
}

/// The lower-case names `sql` calls as functions (a word followed by `(`), outside strings
/// and comments.
pub(crate) fn called_functions(sql: &str) -> BTreeSet<String> {
    let Ok(tokens) = Tokenizer::new(&GenericDialect {}, sql).tokenize() else {
        return BTreeSet::new();
    };
    let words: Vec<&Token> = tokens
        .iter()
        .filter(|t| !matches!(t, Token::Whitespace(_)))
        .collect();
    words
        .windows(2)
        .filter_map(|w| match (w[0], w[1]) {
            (Token::Word(word), Token::LParen) => Some(word.value.to_lowercase()),
            _ => None,
        })
        .collect()
}

fn is_async_call(e: &Expr) -> bool {
    matches!(e, Expr::ScalarFunction(f)
        if f.func.as_async().is_some())
}

fn contains_async_call(e: &Expr) -> bool {
    let mut found = false;
    let _ = e.apply(|e| {
        found |= is_async_call(e);
        Ok(if found {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    });
    found
}

fn placement_hint(name: &str) -> String {
    format!(
        "{name}() runs the model and can be used in SELECT, WHERE, GROUP BY and ORDER BY, but \
         not here (e.g. a JOIN condition or a window); compute it in a subquery first, e.g. \
         `SELECT ... FROM (SELECT *, {name}(text) AS p FROM t) s JOIN ... ON s.p = ...`"
    )
}

/// Replaces each async call in `exprs` by a column computed in `lifted`.
fn lift_exprs(
    exprs: Vec<Expr>,
    lifted: &mut Vec<(Expr, String)>,
    keep_names: bool,
) -> Result<Vec<Expr>> {
    exprs
        .into_iter()
        .map(|expr| {
            let original = expr.schema_name().to_string();
            let rewritten = expr
                .transform_down(|e| {
                    if !is_async_call(&e) {
                        return Ok(Transformed::no(e));
                    }
                    let name = match lifted.iter().find(|(l, _)| *l == e) {
                        Some((_, name)) => name.clone(),
                        None => {
                            let name = format!("__lakeml_call_{}", lifted.len());
                            lifted.push((e, name.clone()));
                            name
                        }
                    };
                    Ok(Transformed::new(col(name), true, TreeNodeRecursion::Jump))
                })?
                .data;
            Ok(
                if keep_names && rewritten.schema_name().to_string() != original {
                    rewritten.alias(original)
                } else {
                    rewritten
                },
            )
        })
        .collect()
}

/// `input` with the lifted calls appended as columns.
fn with_calls(input: Arc<LogicalPlan>, lifted: &[(Expr, String)]) -> Result<LogicalPlan> {
    let mut exprs: Vec<Expr> = input
        .schema()
        .columns()
        .into_iter()
        .map(Expr::Column)
        .collect();
    exprs.extend(lifted.iter().map(|(e, n)| e.clone().alias(n)));
    Ok(LogicalPlan::Projection(Projection::try_new(exprs, input)?))
}

/// Moves model calls out of `GROUP BY`/aggregates and `ORDER BY` into a projection below
/// them, where DataFusion can run them.
pub(crate) fn lift_async_calls(plan: LogicalPlan) -> Result<LogicalPlan> {
    plan.transform_up(|node| match node {
        LogicalPlan::Aggregate(agg)
            if agg
                .group_expr
                .iter()
                .chain(&agg.aggr_expr)
                .any(contains_async_call) =>
        {
            let mut lifted = Vec::new();
            let group = lift_exprs(agg.group_expr, &mut lifted, true)?;
            let aggr = lift_exprs(agg.aggr_expr, &mut lifted, true)?;
            let input = with_calls(agg.input, &lifted)?;
            let rebuilt = Aggregate::try_new(Arc::new(input), group, aggr)?;
            Ok(Transformed::yes(LogicalPlan::Aggregate(rebuilt)))
        }
        LogicalPlan::Sort(sort) if sort.expr.iter().any(|s| contains_async_call(&s.expr)) => {
            let columns: Vec<Expr> = sort
                .input
                .schema()
                .columns()
                .into_iter()
                .map(Expr::Column)
                .collect();
            let mut lifted = Vec::new();
            let mut exprs = Vec::with_capacity(sort.expr.len());
            for s in sort.expr {
                let e = lift_exprs(vec![s.expr.clone()], &mut lifted, false)?.remove(0);
                exprs.push(s.with_expr(e));
            }
            let input = with_calls(sort.input, &lifted)?;
            let sorted = LogicalPlan::Sort(Sort {
                expr: exprs,
                input: Arc::new(input),
                fetch: sort.fetch,
            });
            let back = Projection::try_new(columns, Arc::new(sorted))?;
            Ok(Transformed::yes(LogicalPlan::Projection(back)))
        }
        other => Ok(Transformed::no(other)),
    })
    .map(|t| t.data)
}

/// Refuses a model call where DataFusion cannot run it, with a rewrite to try.
pub(crate) fn check_async_placement(plan: &LogicalPlan) -> Result<()> {
    plan.apply(|node| {
        if matches!(node, LogicalPlan::Projection(_) | LogicalPlan::Filter(_)) {
            return Ok(TreeNodeRecursion::Continue);
        }
        let mut bad = None;
        node.apply_expressions(|e| {
            e.apply(|e| {
                if is_async_call(e)
                    && let Expr::ScalarFunction(f) = e
                {
                    bad = Some(f.name().to_string());
                    return Ok(TreeNodeRecursion::Stop);
                }
                Ok(TreeNodeRecursion::Continue)
            })
        })?;
        match bad {
            Some(name) => plan_err!("{}", placement_hint(&name)),
            None => Ok(TreeNodeRecursion::Continue),
        }
    })
    .map(|_| ())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{AsArray, Int64Array, RecordBatch, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::datasource::MemTable;
    use datafusion::prelude::{DataFrame, SessionContext};

    use super::*;

    /// An async function that upper-cases its text: a stand-in for a model.
    #[derive(Debug, PartialEq, Eq, Hash)]
    struct Upper {
        signature: Signature,
    }

    impl ScalarUDFImpl for Upper {
        fn name(&self) -> &str {
            "upper_async"
        }
        fn signature(&self) -> &Signature {
            &self.signature
        }
        fn return_type(&self, _: &[DataType]) -> Result<DataType> {
            Ok(DataType::Utf8)
        }
        fn invoke_with_args(&self, _: ScalarFunctionArgs) -> Result<ColumnarValue> {
            plan_err!("called synchronously")
        }
    }

    #[async_trait]
    impl AsyncScalarUDFImpl for Upper {
        async fn invoke_async_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
            let texts = args.args[0].to_array(args.number_rows)?;
            let texts = arrow::compute::cast(&texts, &DataType::Utf8)?;
            let upper: StringArray = texts
                .as_string::<i32>()
                .iter()
                .map(|t| t.map(str::to_uppercase))
                .collect();
            Ok(ColumnarValue::Array(Arc::new(upper)))
        }
    }

    fn context() -> SessionContext {
        let ctx = SessionContext::new();
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("text", DataType::Utf8, true),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from(vec![1, 2, 3, 4])),
                Arc::new(StringArray::from(vec![
                    Some("b"),
                    Some("a"),
                    Some("b"),
                    None,
                ])),
            ],
        )
        .expect("batch");
        let table = MemTable::try_new(schema, vec![vec![batch]]).expect("table");
        ctx.register_table("t", Arc::new(table)).expect("register");
        let f = Upper {
            signature: Signature::string(1, Volatility::Volatile),
        };
        ctx.register_udf(AsyncScalarUDF::new(Arc::new(f)).into_scalar_udf());
        ctx
    }

    /// The result of `sql` (model calls lifted as the server does), row by row.
    async fn rows(ctx: &SessionContext, sql: &str) -> Result<Vec<Vec<String>>> {
        let (state, plan) = ctx.sql(sql).await?.into_parts();
        let plan = lift_async_calls(plan)?;
        check_async_placement(&plan)?;
        let mut out = Vec::new();
        for batch in DataFrame::new(state, plan).collect().await? {
            for r in 0..batch.num_rows() {
                out.push(
                    batch
                        .columns()
                        .iter()
                        .map(|c| arrow::util::display::array_value_to_string(c, r))
                        .collect::<Result<Vec<_>, _>>()?,
                );
            }
        }
        Ok(out)
    }

    fn table(rows: &[&[&str]]) -> Vec<Vec<String>> {
        rows.iter()
            .map(|r| r.iter().map(|c| c.to_string()).collect())
            .collect()
    }

    #[tokio::test]
    async fn calls_in_group_by_and_order_by_run() {
        let ctx = context();
        let grouped = rows(
            &ctx,
            "SELECT upper_async(text) AS l, count(*) AS n FROM t GROUP BY l ORDER BY l NULLS LAST",
        )
        .await
        .expect("group by");
        assert_eq!(grouped, table(&[&["A", "1"], &["B", "2"], &["", "1"]]));
        let ordered = rows(
            &ctx,
            "SELECT id FROM t ORDER BY upper_async(text) NULLS LAST, id",
        )
        .await
        .expect("order by");
        assert_eq!(ordered, table(&[&["2"], &["1"], &["3"], &["4"]]));
        let filtered = rows(
            &ctx,
            "SELECT id, upper_async(text) FROM t WHERE upper_async(text) = 'B' ORDER BY id",
        )
        .await
        .expect("select and where");
        assert_eq!(filtered, table(&[&["1", "B"], &["3", "B"]]));
    }

    #[tokio::test]
    async fn a_call_in_a_join_condition_is_refused_with_a_rewrite() {
        let ctx = context();
        let err = rows(
            &ctx,
            "SELECT a.id FROM t a JOIN t b ON upper_async(a.text) = b.text",
        )
        .await
        .expect_err("join condition");
        let text = err.to_string();
        assert!(text.contains("subquery"), "{text}");
        assert!(text.contains("upper_async"), "{text}");
    }
}
