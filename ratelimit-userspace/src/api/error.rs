//! [`ApiError`], a refused or failed request, and the answers for requests no route takes. Its
//! own room because every handler and the backend answer errors through it, with one shape:
//! a status and `{"error": "..."}`.

use axum::{
    extract::rejection::{PathRejection, QueryRejection},
    http::{Method, StatusCode, Uri},
    response::{IntoResponse, Response},
    Json,
};
use serde::Serialize;
use serde_json::{json, Value};

use crate::agent::AgentError;

/// A refused or failed request: its status and the message of `{"error": ...}`.
#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    pub(super) message: String,
}

impl ApiError {
    pub(super) fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    /// The status the request is answered with.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The message of `{"error": ...}`.
    #[must_use]
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<AgentError> for ApiError {
    fn from(e: AgentError) -> Self {
        let status = match &e {
            AgentError::NoSuchRule(_) => StatusCode::NOT_FOUND,
            AgentError::RuleExists(_)
            | AgentError::Compile { .. }
            | AgentError::FileChanged { .. } => StatusCode::CONFLICT,
            AgentError::Config(_) => StatusCode::UNPROCESSABLE_ENTITY,
            AgentError::BadRequest(_)
            | AgentError::NoSuchInterface { .. }
            | AgentError::NoInterfaces(_) => StatusCode::BAD_REQUEST,
            AgentError::Dataplane(_) | AgentError::Maps(_) | AgentError::Runtime(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        Self {
            status,
            message: e.to_string(),
        }
    }
}

/// A query string axum cannot read (a key given twice, say): 400 with the API's `{"error": ...}`
/// (axum's own rejection is plain text).
impl From<QueryRejection> for ApiError {
    fn from(e: QueryRejection) -> Self {
        Self {
            status: e.status(),
            message: e.body_text(),
        }
    }
}

/// A path axum cannot read (a rule name that is not UTF-8 once decoded): as above.
impl From<PathRejection> for ApiError {
    fn from(e: PathRejection) -> Self {
        Self {
            status: e.status(),
            message: e.body_text(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({ "error": self.message }))).into_response()
    }
}

pub(super) type ApiResult<T = Json<Value>> = Result<T, ApiError>;

pub(super) fn to_json(v: &impl Serialize) -> Result<Value, ApiError> {
    serde_json::to_value(v).map_err(|e| ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: format!("encoding the answer: {e}"),
    })
}

pub(super) async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!(
            "no route {method} {}: the routes are /v1/status, /v1/rules, /v1/rules/NAME, /v1/reload, /v1/stats, /v1/top, /v1/explain, /v1/detach",
            uri.path()
        ),
    }
}

pub(super) async fn no_method(method: Method, uri: Uri) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!("{} does not take {method}", uri.path()),
    }
}
