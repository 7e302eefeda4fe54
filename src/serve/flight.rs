//! The Flight SQL service: authentication, statements and prepared statements, metadata,
//! and DoExchange (in `exchange.rs`), over [`Lake`] sessions.
//!
//! Tickets are stateless: each holds the SQL, its bound parameters, the Delta versions the
//! query was planned against and, when the result is offered as several endpoints, the
//! output partition, so a ticket can be fetched again and every endpoint reads one snapshot.
//! A ticket is authorised again when it is fetched, like any call.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow::array::{ArrayRef, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::sql::metadata::{
    SqlInfoData, SqlInfoDataBuilder, XdbcTypeInfo, XdbcTypeInfoData, XdbcTypeInfoDataBuilder,
};
use arrow_flight::sql::server::{FlightSqlService, PeekableFlightDataStream};
use arrow_flight::sql::{
    ActionClosePreparedStatementRequest, ActionCreatePreparedStatementRequest,
    ActionCreatePreparedStatementResult, Any, CommandGetCatalogs, CommandGetDbSchemas,
    CommandGetSqlInfo, CommandGetTableTypes, CommandGetTables, CommandGetXdbcTypeInfo,
    CommandPreparedStatementQuery, CommandPreparedStatementUpdate, CommandStatementIngest,
    CommandStatementQuery, CommandStatementUpdate, DoPutPreparedStatementResult, Nullable,
    ProstMessageExt, Searchable, SqlInfo, TicketStatementQuery, XdbcDataType,
};
use arrow_flight::{
    FlightData, FlightDescriptor, FlightEndpoint, FlightInfo, HandshakeRequest, HandshakeResponse,
    Ticket, decode::FlightRecordBatchStream, flight_service_server::FlightService,
};
use datafusion::common::{ParamValues, ScalarValue};
use datafusion::error::DataFusionError;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};
use futures::{Stream, StreamExt, TryStreamExt};
use prost::Message;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status, Streaming};

use super::auth::{Auth, Principal};
use super::lake::{CATALOG, Lake, Refusal, SCHEMA, Versions, plan};
use super::scorer::Scorer;

pub(super) type FlightStream =
    Pin<Box<dyn Stream<Item = Result<FlightData, Status>> + Send + 'static>>;

/// Physical operators that work on each partition alone: a plan made only of these can be
/// offered as one endpoint per partition, each read independently.
const PARTITION_LOCAL: &[&str] = &[
    "DataSourceExec",
    "DeltaScan",
    // delta-rs' scan node; a table with deletion vectors has it on a single partition.
    "DeltaScanExec",
    "ProjectionExec",
    "FilterExec",
    "CoalesceBatchesExec",
    "AsyncFuncExec",
    "CooperativeExec",
];

/// A prepared statement: its SQL and, once bound with DoPut, its parameters.
struct Prepared {
    sql: String,
    owner: String,
    params: Option<Vec<Param>>,
}

/// A bound parameter, as it travels in a ticket.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Param {
    r#type: String,
    value: Option<String>,
}

/// What a statement ticket holds.
#[derive(Debug, Serialize, Deserialize)]
struct TicketBody {
    sql: String,
    #[serde(default)]
    params: Option<Vec<Param>>,
    versions: Versions,
    /// The output partition this endpoint reads; `None`: all of them, merged.
    partition: Option<usize>,
}

/// The server's state, shared by every call.
pub(crate) struct Service {
    pub(super) lake: Lake,
    /// Models by SQL function prefix (each model's name, and `predict`).
    pub(super) scorers: BTreeMap<String, Arc<Scorer>>,
    pub(super) auth: Option<Arc<Auth>>,
    pub(super) queries: Arc<Semaphore>,
    pub(super) max_queries: usize,
    pub(super) query_timeout: Duration,
    prepared: Mutex<HashMap<String, Prepared>>,
    sql_info: SqlInfoData,
    xdbc: XdbcTypeInfoData,
}

/// A refusal as the status a client sees.
fn status(r: Refusal) -> Status {
    match r {
        Refusal::Query(m) => Status::invalid_argument(m),
        Refusal::Server(e) => Status::internal(e.to_string()),
    }
}

fn df_status(e: DataFusionError) -> Status {
    let text = e.strip_backtrace();
    match e {
        DataFusionError::Plan(_) | DataFusionError::SQL(..) | DataFusionError::SchemaError(..) => {
            Status::invalid_argument(text)
        }
        DataFusionError::ResourcesExhausted(_) => Status::resource_exhausted(text),
        _ => Status::internal(text),
    }
}

/// The type a column travels as: plain `Utf8`/`Binary` instead of view types, values
/// instead of dictionaries, which older JDBC and ODBC drivers need.
fn wire_type(t: &DataType) -> DataType {
    match t {
        DataType::Utf8View => DataType::Utf8,
        DataType::BinaryView => DataType::Binary,
        DataType::Dictionary(_, v) => wire_type(v),
        DataType::List(f) => DataType::List(Arc::new(wire_field(f))),
        DataType::LargeList(f) => DataType::LargeList(Arc::new(wire_field(f))),
        DataType::Struct(fs) => DataType::Struct(fs.iter().map(|f| wire_field(f)).collect()),
        other => other.clone(),
    }
}

fn wire_field(f: &Field) -> Field {
    f.clone().with_data_type(wire_type(f.data_type()))
}

pub(super) fn wire_schema(s: &Schema) -> SchemaRef {
    Arc::new(Schema::new_with_metadata(
        s.fields().iter().map(|f| wire_field(f)).collect::<Vec<_>>(),
        s.metadata().clone(),
    ))
}

/// `batch` with the columns of `schema` (casting view and dictionary columns).
pub(super) fn to_wire(batch: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch, FlightError> {
    let columns = batch
        .columns()
        .iter()
        .zip(schema.fields())
        .map(|(c, f)| {
            if c.data_type() == f.data_type() {
                Ok(c.clone())
            } else {
                arrow::compute::cast(c, f.data_type())
            }
        })
        .collect::<Result<Vec<ArrayRef>, _>>()?;
    Ok(RecordBatch::try_new(schema.clone(), columns)?)
}

/// The IPC form of a schema that Flight messages carry.
fn ipc_schema(schema: &Schema) -> Result<prost::bytes::Bytes, Status> {
    FlightInfo::new()
        .try_with_schema(schema)
        .map(|i| i.schema)
        .map_err(|e| Status::internal(format!("encoding a schema: {e}")))
}

fn batch_stream(schema: SchemaRef, batch: Result<RecordBatch, FlightError>) -> FlightStream {
    Box::pin(
        FlightDataEncoderBuilder::new()
            .with_schema(schema)
            .build(futures::stream::once(async move { batch }))
            .map_err(Status::from),
    )
}

fn params_to_values(params: &[Param]) -> Result<ParamValues, Status> {
    let mut values = Vec::with_capacity(params.len());
    for (i, p) in params.iter().enumerate() {
        let t: DataType = p.r#type.parse().map_err(|e| {
            Status::invalid_argument(format!("parameter {}: type `{}`: {e}", i + 1, p.r#type))
        })?;
        let v = match &p.value {
            None => ScalarValue::try_from(&t),
            Some(text) => ScalarValue::try_from_string(text.clone(), &t),
        }
        .map_err(|e| Status::invalid_argument(format!("parameter {}: {e}", i + 1)))?;
        values.push(v);
    }
    Ok(ParamValues::from(values))
}

/// One row of bound parameters, from the batches a client sent with DoPut.
fn params_from_batches(batches: &[RecordBatch]) -> Result<Vec<Param>, Status> {
    let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
    let Some(batch) = batches.iter().find(|b| b.num_rows() > 0) else {
        return Ok(Vec::new());
    };
    if rows > 1 {
        return Err(Status::invalid_argument(format!(
            "{rows} rows of parameters were bound; bind one row per execution"
        )));
    }
    batch
        .columns()
        .iter()
        .map(|c| {
            let v = ScalarValue::try_from_array(c, 0)
                .map_err(|e| Status::invalid_argument(format!("a bound parameter: {e}")))?;
            Ok(Param {
                r#type: c.data_type().to_string(),
                value: (!v.is_null()).then(|| v.to_string()),
            })
        })
        .collect()
}

fn partition_local(plan: &Arc<dyn ExecutionPlan>) -> bool {
    PARTITION_LOCAL.contains(&plan.name()) && plan.children().iter().all(|c| partition_local(c))
}

impl Service {
    pub(super) fn new(
        lake: Lake,
        scorers: BTreeMap<String, Arc<Scorer>>,
        auth: Option<Arc<Auth>>,
        max_queries: usize,
        query_timeout: Duration,
    ) -> crate::Result<Self> {
        let internal = |e: FlightError| crate::Error::Internal(e.to_string());
        let mut info = SqlInfoDataBuilder::new();
        info.append(SqlInfo::FlightSqlServerName, "lakeml");
        info.append(SqlInfo::FlightSqlServerVersion, env!("CARGO_PKG_VERSION"));
        info.append(SqlInfo::FlightSqlServerArrowVersion, "59");
        info.append(SqlInfo::FlightSqlServerReadOnly, true);
        info.append(SqlInfo::FlightSqlServerSql, true);
        info.append(SqlInfo::FlightSqlServerSubstrait, false);
        info.append(SqlInfo::FlightSqlServerTransaction, 0i32);
        info.append(SqlInfo::FlightSqlServerCancel, false);
        info.append(SqlInfo::SqlIdentifierQuoteChar, "\"");
        info.append(SqlInfo::SqlDdlCatalog, false);
        info.append(SqlInfo::SqlDdlSchema, false);
        info.append(SqlInfo::SqlDdlTable, false);
        let mut xdbc = XdbcTypeInfoDataBuilder::new();
        for (name, data_type, size) in [
            ("VARCHAR", XdbcDataType::XdbcVarchar, None),
            ("BIGINT", XdbcDataType::XdbcBigint, Some(64)),
            ("INTEGER", XdbcDataType::XdbcInteger, Some(32)),
            ("SMALLINT", XdbcDataType::XdbcSmallint, Some(16)),
            ("TINYINT", XdbcDataType::XdbcTinyint, Some(8)),
            ("BOOLEAN", XdbcDataType::XdbcBit, Some(1)),
            ("FLOAT", XdbcDataType::XdbcFloat, Some(24)),
            ("DOUBLE", XdbcDataType::XdbcDouble, Some(53)),
            ("DATE", XdbcDataType::XdbcDate, None),
            ("TIMESTAMP", XdbcDataType::XdbcTimestamp, None),
            ("VARBINARY", XdbcDataType::XdbcVarbinary, None),
        ] {
            let text = matches!(name, "VARCHAR");
            xdbc.append(XdbcTypeInfo {
                type_name: name.into(),
                data_type,
                column_size: size,
                literal_prefix: text.then(|| "'".into()),
                literal_suffix: text.then(|| "'".into()),
                create_params: None,
                nullable: Nullable::NullabilityNullable,
                case_sensitive: text,
                searchable: Searchable::Full,
                unsigned_attribute: size.map(|_| false),
                fixed_prec_scale: false,
                auto_increment: Some(false),
                local_type_name: Some(name.into()),
                minimum_scale: None,
                maximum_scale: None,
                sql_data_type: data_type,
                datetime_subcode: None,
                num_prec_radix: size.map(|_| 2),
                interval_precision: None,
            });
        }
        Ok(Self {
            lake,
            scorers,
            auth,
            queries: Arc::new(Semaphore::new(max_queries)),
            max_queries,
            query_timeout,
            prepared: Mutex::new(HashMap::new()),
            sql_info: info.build().map_err(internal)?,
            xdbc: xdbc.build().map_err(internal)?,
        })
    }

    /// The caller of a request (anyone, when the server has no `auth`).
    pub(super) fn who<T>(&self, request: &Request<T>) -> Result<Principal, Status> {
        match &self.auth {
            Some(auth) => auth.check(request.metadata()),
            None => Ok(Principal::anonymous()),
        }
    }

    /// A slot among the queries allowed to run at once, or RESOURCE_EXHAUSTED.
    pub(super) fn slot(&self) -> Result<tokio::sync::OwnedSemaphorePermit, Status> {
        self.queries.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "{} queries are running, the most this server takes at once \
                 (serve.limits.max_concurrent_queries); retry shortly",
                self.max_queries
            ))
        })
    }

    /// Plans `sql` (at `versions`, or the tables' latest) into a physical plan.
    async fn physical(
        &self,
        who: &Principal,
        sql: &str,
        params: Option<&[Param]>,
        versions: Option<&Versions>,
    ) -> Result<
        (
            Arc<dyn ExecutionPlan>,
            Versions,
            Arc<datafusion::execution::TaskContext>,
        ),
        Status,
    > {
        let (ctx, versions) = self
            .lake
            .session(who, versions)
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        let values = params.map(params_to_values).transpose()?;
        let df = plan(&ctx, who, sql, values).await.map_err(status)?;
        let task = Arc::new(df.task_ctx());
        let physical = df.create_physical_plan().await.map_err(df_status)?;
        Ok((physical, versions, task))
    }

    /// FlightInfo of a query: its schema, and one endpoint per independent partition.
    async fn info(
        &self,
        who: &Principal,
        sql: String,
        params: Option<Vec<Param>>,
        descriptor: FlightDescriptor,
    ) -> Result<Response<FlightInfo>, Status> {
        let (physical, versions, _) = self.physical(who, &sql, params.as_deref(), None).await?;
        let schema = wire_schema(&physical.schema());
        let partitions = physical.output_partitioning().partition_count();
        let parts: Vec<Option<usize>> = if partitions > 1 && partition_local(&physical) {
            (0..partitions).map(Some).collect()
        } else {
            vec![None]
        };
        let mut info = FlightInfo::new()
            .try_with_schema(&schema)
            .map_err(|e| Status::internal(format!("encoding the schema: {e}")))?
            .with_descriptor(descriptor)
            .with_ordered(parts.len() == 1);
        for partition in parts {
            let body = TicketBody {
                sql: sql.clone(),
                params: params.clone(),
                versions: versions.clone(),
                partition,
            };
            let handle = serde_json::to_vec(&body)
                .map_err(|e| Status::internal(format!("encoding a ticket: {e}")))?;
            let ticket = TicketStatementQuery {
                statement_handle: handle.into(),
            };
            info = info.with_endpoint(
                FlightEndpoint::new().with_ticket(Ticket::new(ticket.as_any().encode_to_vec())),
            );
        }
        Ok(Response::new(info))
    }

    /// Runs a ticket's query and streams its result.
    async fn run(
        &self,
        who: Principal,
        body: TicketBody,
    ) -> Result<Response<FlightStream>, Status> {
        let permit = self.slot()?;
        let started = Instant::now();
        let (physical, _, task) = self
            .physical(
                &who,
                &body.sql,
                body.params.as_deref(),
                Some(&body.versions),
            )
            .await?;
        let schema = wire_schema(&physical.schema());
        let stream = match body.partition {
            None => datafusion::physical_plan::execute_stream(physical, task),
            Some(p) if p < physical.output_partitioning().partition_count() => {
                physical.execute(p, task)
            }
            Some(p) => {
                return Err(Status::invalid_argument(format!(
                    "the ticket names partition {p}, which this query no longer has; get a \
                     new FlightInfo"
                )));
            }
        }
        .map_err(df_status)?;
        let wire = schema.clone();
        let batches = stream
            .map_err(|e| FlightError::Tonic(Box::new(df_status(e))))
            .and_then(move |b| futures::future::ready(to_wire(&b, &wire)));
        let batches = limited(batches, self.query_timeout, permit, who.name, started);
        let out = FlightDataEncoderBuilder::new()
            .with_schema(schema)
            .build(batches)
            .map_err(Status::from);
        Ok(Response::new(Box::pin(out)))
    }

    fn prepared_sql(
        &self,
        who: &Principal,
        handle: &[u8],
    ) -> Result<(String, Option<Vec<Param>>), Status> {
        let key = String::from_utf8_lossy(handle).into_owned();
        let prepared = self
            .prepared
            .lock()
            .map_err(|_| Status::internal("prepared statements poisoned"))?;
        match prepared.get(&key) {
            Some(p) if p.owner == who.name => Ok((p.sql.clone(), p.params.clone())),
            _ => Err(Status::invalid_argument(
                "unknown prepared statement handle (closed, or from another session); prepare \
                 the statement again",
            )),
        }
    }
}

/// `batches` bounded by the query timeout; the concurrency slot is held until the stream
/// ends or is dropped (a client that disconnects frees it and stops the query).
pub(super) fn limited<S>(
    batches: S,
    timeout: Duration,
    permit: tokio::sync::OwnedSemaphorePermit,
    user: String,
    started: Instant,
) -> impl Stream<Item = Result<RecordBatch, FlightError>> + Send + 'static
where
    S: Stream<Item = Result<RecordBatch, FlightError>> + Send + 'static,
{
    struct State<S> {
        batches: Pin<Box<S>>,
        deadline: Pin<Box<tokio::time::Sleep>>,
        done: bool,
        rows: usize,
        _permit: tokio::sync::OwnedSemaphorePermit,
    }
    let state = State {
        batches: Box::pin(batches),
        deadline: Box::pin(tokio::time::sleep(timeout)),
        done: false,
        rows: 0,
        _permit: permit,
    };
    futures::stream::unfold(state, move |mut s| {
        let user = user.clone();
        async move {
            if s.done {
                return None;
            }
            tokio::select! {
                next = s.batches.next() => match next {
                    Some(Ok(b)) => {
                        s.rows += b.num_rows();
                        Some((Ok(b), s))
                    }
                    Some(Err(e)) => {
                        s.done = true;
                        Some((Err(e), s))
                    }
                    None => {
                        eprintln!(
                            "lakeml serve: {user}: query done, {} rows in {:.2}s",
                            s.rows,
                            started.elapsed().as_secs_f64()
                        );
                        None
                    }
                },
                () = &mut s.deadline => {
                    s.done = true;
                    let status = Status::deadline_exceeded(format!(
                        "the query ran longer than {}s (serve.limits.query_timeout) and was \
                         stopped",
                        timeout.as_secs_f64()
                    ));
                    Some((Err(FlightError::Tonic(Box::new(status))), s))
                }
            }
        }
    })
}

#[tonic::async_trait]
impl FlightSqlService for Service {
    type FlightService = Service;

    async fn do_handshake(
        &self,
        request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<
        Response<Pin<Box<dyn Stream<Item = Result<HandshakeResponse, Status>> + Send>>>,
        Status,
    > {
        let header = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let token = match (&self.auth, header) {
            (Some(auth), Some(h)) => auth.login(&h).await?,
            (Some(_), None) => {
                return Err(Status::unauthenticated(
                    "the handshake needs Basic credentials (user and password)",
                ));
            }
            // No auth configured: any caller is welcome; the token is only a formality.
            (None, _) => uuid::Uuid::new_v4().simple().to_string(),
        };
        let reply = HandshakeResponse {
            protocol_version: 0,
            payload: token.clone().into_bytes().into(),
        };
        let stream: Pin<Box<dyn Stream<Item = Result<HandshakeResponse, Status>> + Send>> =
            Box::pin(futures::stream::iter(vec![Ok(reply)]));
        let mut response = Response::new(stream);
        let value = MetadataValue::try_from(format!("Bearer {token}"))
            .map_err(|e| Status::internal(format!("token header: {e}")))?;
        response.metadata_mut().insert("authorization", value);
        Ok(response)
    }

    async fn get_flight_info_statement(
        &self,
        query: CommandStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let who = self.who(&request)?;
        self.info(&who, query.query, None, request.into_inner())
            .await
    }

    async fn get_flight_info_prepared_statement(
        &self,
        query: CommandPreparedStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let who = self.who(&request)?;
        let (sql, params) = self.prepared_sql(&who, &query.prepared_statement_handle)?;
        self.info(&who, sql, params, request.into_inner()).await
    }

    async fn do_get_statement(
        &self,
        ticket: TicketStatementQuery,
        request: Request<Ticket>,
    ) -> Result<Response<FlightStream>, Status> {
        let who = self.who(&request)?;
        let body: TicketBody = serde_json::from_slice(&ticket.statement_handle).map_err(|e| {
            Status::invalid_argument(format!(
                "malformed ticket ({e}); use a ticket from this server's FlightInfo"
            ))
        })?;
        self.run(who, body).await
    }

    async fn do_get_prepared_statement(
        &self,
        query: CommandPreparedStatementQuery,
        request: Request<Ticket>,
    ) -> Result<Response<FlightStream>, Status> {
        let who = self.who(&request)?;
        let (sql, params) = self.prepared_sql(&who, &query.prepared_statement_handle)?;
        self.run(
            who,
            TicketBody {
                sql,
                params,
                versions: Versions::new(),
                partition: None,
            },
        )
        .await
    }

    async fn do_get_fallback(
        &self,
        request: Request<Ticket>,
        message: Any,
    ) -> Result<Response<FlightStream>, Status> {
        self.who(&request)?;
        Err(Status::invalid_argument(format!(
            "malformed ticket: `{}` is not a ticket this server issues; use a ticket from its \
             FlightInfo",
            message.type_url
        )))
    }

    async fn do_action_create_prepared_statement(
        &self,
        query: ActionCreatePreparedStatementRequest,
        request: Request<arrow_flight::Action>,
    ) -> Result<ActionCreatePreparedStatementResult, Status> {
        let who = self.who(&request)?;
        let (ctx, _) = self
            .lake
            .session(&who, None)
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        let df = plan(&ctx, &who, &query.query, None).await.map_err(status)?;
        let types = df.logical_plan().get_parameter_types().map_err(df_status)?;
        let mut names: Vec<&String> = types.keys().collect();
        names.sort_by_key(|n| {
            n.trim_start_matches('$')
                .parse::<usize>()
                .unwrap_or(usize::MAX)
        });
        let parameters = Schema::new(
            names
                .iter()
                .map(|n| {
                    let t = types[*n].clone().unwrap_or(DataType::Null);
                    Field::new(n.trim_start_matches('$'), t, true)
                })
                .collect::<Vec<_>>(),
        );
        let dataset = wire_schema(df.schema().as_arrow());
        let handle = uuid::Uuid::new_v4().simple().to_string();
        self.prepared
            .lock()
            .map_err(|_| Status::internal("prepared statements poisoned"))?
            .insert(
                handle.clone(),
                Prepared {
                    sql: query.query,
                    owner: who.name,
                    params: None,
                },
            );
        Ok(ActionCreatePreparedStatementResult {
            prepared_statement_handle: handle.into_bytes().into(),
            dataset_schema: ipc_schema(&dataset)?,
            parameter_schema: ipc_schema(&parameters)?,
        })
    }

    async fn do_put_prepared_statement_query(
        &self,
        query: CommandPreparedStatementQuery,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<DoPutPreparedStatementResult, Status> {
        let who = self.who(&request)?;
        self.prepared_sql(&who, &query.prepared_statement_handle)?;
        let stream = request
            .into_inner()
            .map_err(|s| FlightError::Tonic(Box::new(s)));
        let batches: Vec<RecordBatch> = FlightRecordBatchStream::new_from_flight_data(stream)
            .try_collect()
            .await
            .map_err(|e| Status::invalid_argument(format!("reading the parameters: {e}")))?;
        let params = params_from_batches(&batches)?;
        let key = String::from_utf8_lossy(&query.prepared_statement_handle).into_owned();
        if let Some(p) = self
            .prepared
            .lock()
            .map_err(|_| Status::internal("prepared statements poisoned"))?
            .get_mut(&key)
        {
            p.params = Some(params);
        }
        Ok(DoPutPreparedStatementResult {
            prepared_statement_handle: Some(query.prepared_statement_handle),
        })
    }

    async fn do_put_statement_update(
        &self,
        _query: CommandStatementUpdate,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        self.who(&request)?;
        Err(read_only())
    }

    async fn do_put_prepared_statement_update(
        &self,
        _query: CommandPreparedStatementUpdate,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        self.who(&request)?;
        Err(read_only())
    }

    async fn do_put_statement_ingest(
        &self,
        _query: CommandStatementIngest,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        self.who(&request)?;
        Err(read_only())
    }

    async fn do_action_close_prepared_statement(
        &self,
        query: ActionClosePreparedStatementRequest,
        request: Request<arrow_flight::Action>,
    ) -> Result<(), Status> {
        let who = self.who(&request)?;
        let key = String::from_utf8_lossy(&query.prepared_statement_handle).into_owned();
        let mut prepared = self
            .prepared
            .lock()
            .map_err(|_| Status::internal("prepared statements poisoned"))?;
        if prepared.get(&key).is_some_and(|p| p.owner == who.name) {
            prepared.remove(&key);
        }
        Ok(())
    }

    async fn get_flight_info_catalogs(
        &self,
        query: CommandGetCatalogs,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.who(&request)?;
        let schema = query.into_builder().schema();
        metadata_info(&schema, query.as_any(), request.into_inner())
    }

    async fn do_get_catalogs(
        &self,
        query: CommandGetCatalogs,
        request: Request<Ticket>,
    ) -> Result<Response<FlightStream>, Status> {
        self.who(&request)?;
        let mut builder = query.into_builder();
        builder.append(CATALOG);
        let schema = builder.schema();
        Ok(Response::new(batch_stream(schema, builder.build())))
    }

    async fn get_flight_info_schemas(
        &self,
        query: CommandGetDbSchemas,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.who(&request)?;
        let schema = query.clone().into_builder().schema();
        metadata_info(&schema, query.as_any(), request.into_inner())
    }

    async fn do_get_schemas(
        &self,
        query: CommandGetDbSchemas,
        request: Request<Ticket>,
    ) -> Result<Response<FlightStream>, Status> {
        self.who(&request)?;
        let mut builder = query.into_builder();
        builder.append(CATALOG, SCHEMA);
        let schema = builder.schema();
        Ok(Response::new(batch_stream(schema, builder.build())))
    }

    async fn get_flight_info_tables(
        &self,
        query: CommandGetTables,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.who(&request)?;
        let schema = query.clone().into_builder().schema();
        metadata_info(&schema, query.as_any(), request.into_inner())
    }

    async fn do_get_tables(
        &self,
        query: CommandGetTables,
        request: Request<Ticket>,
    ) -> Result<Response<FlightStream>, Status> {
        let who = self.who(&request)?;
        let (ctx, _) = self
            .lake
            .session(&who, None)
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        let mut builder = query.into_builder();
        let mut names: Vec<&str> = self.lake.names().filter(|n| who.may_read(n)).collect();
        names.sort_unstable();
        for name in names {
            // A declared table not written yet has no schema to show: left out.
            let Ok(provider) = ctx.table_provider(name).await else {
                continue;
            };
            builder
                .append(
                    CATALOG,
                    SCHEMA,
                    name,
                    "TABLE",
                    &wire_schema(&provider.schema()),
                )
                .map_err(Status::from)?;
        }
        let schema = builder.schema();
        Ok(Response::new(batch_stream(schema, builder.build())))
    }

    async fn get_flight_info_table_types(
        &self,
        query: CommandGetTableTypes,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.who(&request)?;
        let schema = query.into_builder().schema();
        metadata_info(&schema, query.as_any(), request.into_inner())
    }

    async fn do_get_table_types(
        &self,
        query: CommandGetTableTypes,
        request: Request<Ticket>,
    ) -> Result<Response<FlightStream>, Status> {
        self.who(&request)?;
        let mut builder = query.into_builder();
        builder.append("TABLE");
        let schema = builder.schema();
        Ok(Response::new(batch_stream(schema, builder.build())))
    }

    async fn get_flight_info_sql_info(
        &self,
        query: CommandGetSqlInfo,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.who(&request)?;
        let schema = query.clone().into_builder(&self.sql_info).schema();
        metadata_info(&schema, query.as_any(), request.into_inner())
    }

    async fn do_get_sql_info(
        &self,
        query: CommandGetSqlInfo,
        request: Request<Ticket>,
    ) -> Result<Response<FlightStream>, Status> {
        self.who(&request)?;
        let builder = query.into_builder(&self.sql_info);
        let schema = builder.schema();
        Ok(Response::new(batch_stream(schema, builder.build())))
    }

    async fn get_flight_info_xdbc_type_info(
        &self,
        query: CommandGetXdbcTypeInfo,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.who(&request)?;
        let schema = query.into_builder(&self.xdbc).schema();
        metadata_info(&schema, query.as_any(), request.into_inner())
    }

    async fn do_get_xdbc_type_info(
        &self,
        query: CommandGetXdbcTypeInfo,
        request: Request<Ticket>,
    ) -> Result<Response<FlightStream>, Status> {
        self.who(&request)?;
        let builder = query.into_builder(&self.xdbc);
        let schema = builder.schema();
        Ok(Response::new(batch_stream(schema, builder.build())))
    }

    async fn do_exchange_fallback(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<<Self as FlightService>::DoExchangeStream>, Status> {
        let who = self.who(&request)?;
        let permit = self.slot()?;
        let started = Instant::now();
        let scored = super::exchange::exchange(&self.scorers, request.into_inner()).await?;
        let wired = scored.and_then(|b| {
            let schema = wire_schema(&b.schema());
            futures::future::ready(to_wire(&b, &schema))
        });
        let limited = limited(wired, self.query_timeout, permit, who.name, started);
        let out = FlightDataEncoderBuilder::new()
            .build(limited)
            .map_err(Status::from);
        Ok(Response::new(Box::pin(out)))
    }

    async fn register_sql_info(&self, _id: i32, _result: &SqlInfo) {}
}

/// The answer to any call that would write.
fn read_only() -> Status {
    Status::invalid_argument(
        "lakeml serve is read-only: updates and ingestion are not allowed; tables are written \
         by `pipeline run`",
    )
}

/// What tonic serves: the Flight SQL service, with the caller checked before anything is
/// decoded, and malformed tickets and descriptors answered in words (arrow-flight's own
/// answer is a raw protobuf decode error).
pub(super) struct Front(pub Arc<Service>);

#[tonic::async_trait]
impl FlightService for Front {
    type HandshakeStream = <Service as FlightService>::HandshakeStream;
    type ListFlightsStream = <Service as FlightService>::ListFlightsStream;
    type DoGetStream = <Service as FlightService>::DoGetStream;
    type DoPutStream = <Service as FlightService>::DoPutStream;
    type DoActionStream = <Service as FlightService>::DoActionStream;
    type ListActionsStream = <Service as FlightService>::ListActionsStream;
    type DoExchangeStream = <Service as FlightService>::DoExchangeStream;

    async fn handshake(
        &self,
        request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        FlightService::handshake(self.0.as_ref(), request).await
    }

    async fn list_flights(
        &self,
        request: Request<arrow_flight::Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        self.0.who(&request)?;
        FlightService::list_flights(self.0.as_ref(), request).await
    }

    async fn get_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.0.who(&request)?;
        if Any::decode(&*request.get_ref().cmd).is_err() {
            return Err(Status::invalid_argument(
                "malformed descriptor: its command is not a Flight SQL command; send a \
                 statement query (CommandStatementQuery) or another Flight SQL command",
            ));
        }
        FlightService::get_flight_info(self.0.as_ref(), request).await
    }

    async fn poll_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<arrow_flight::PollInfo>, Status> {
        self.0.who(&request)?;
        FlightService::poll_flight_info(self.0.as_ref(), request).await
    }

    async fn get_schema(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<arrow_flight::SchemaResult>, Status> {
        self.0.who(&request)?;
        FlightService::get_schema(self.0.as_ref(), request).await
    }

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> Result<Response<Self::DoGetStream>, Status> {
        self.0.who(&request)?;
        if Any::decode(&*request.get_ref().ticket).is_err() {
            return Err(Status::invalid_argument(
                "malformed ticket: not one this server issued; use a ticket from this \
                 server's FlightInfo",
            ));
        }
        FlightService::do_get(self.0.as_ref(), request).await
    }

    async fn do_put(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        self.0.who(&request)?;
        FlightService::do_put(self.0.as_ref(), request).await
    }

    async fn do_action(
        &self,
        request: Request<arrow_flight::Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        self.0.who(&request)?;
        FlightService::do_action(self.0.as_ref(), request).await
    }

    async fn list_actions(
        &self,
        request: Request<arrow_flight::Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        self.0.who(&request)?;
        FlightService::list_actions(self.0.as_ref(), request).await
    }

    async fn do_exchange(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        self.0.who(&request)?;
        FlightService::do_exchange(self.0.as_ref(), request).await
    }
}

/// FlightInfo of a metadata command: one endpoint whose ticket is the command itself.
fn metadata_info(
    schema: &Schema,
    command: Any,
    descriptor: FlightDescriptor,
) -> Result<Response<FlightInfo>, Status> {
    let info = FlightInfo::new()
        .try_with_schema(schema)
        .map_err(|e| Status::internal(format!("encoding the schema: {e}")))?
        .with_endpoint(FlightEndpoint::new().with_ticket(Ticket::new(command.encode_to_vec())))
        .with_descriptor(descriptor);
    Ok(Response::new(info))
}
