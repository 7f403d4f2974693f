"""The daemon's JSON, typed: generated from the OpenAPI document in docs/api.md by
python/tools/gen_models.py. Do not edit; run the generator (a test fails when this
file and the document differ)."""
# ruff: noqa
from __future__ import annotations

from typing import Any, Literal, TypedDict

API_VERSION = '0.1.0'

class _TaskSpecTeamRequired(TypedDict):
    team: dict[str, Any]


class TaskSpecTeam(_TaskSpecTeamRequired, total=False):
    """a team of agents; its fields are documented in docs/teams.md"""

    agents: dict[str, dict[str, Any]]


class TaskSpecCheck(TypedDict, total=False):
    """decides whether the task was solved, run in its sandbox after it ends (docs/eval.md)"""

    expect: str
    file: str
    contents: str
    program: str
    language: str
    value: Any  # the value the answer must give: a number, a string or a list of them (docs/eval.md)
    tolerance: float  # how far a number of the answer may be from a numeric value


class _TaskSpecToolsItem2Required(TypedDict):
    name: str
    command: list[str]  # run in the task's sandbox


class TaskSpecToolsItem2(_TaskSpecToolsItem2Required, total=False):
    """The API's `TaskSpecToolsItem2`."""

    description: str
    parameters: dict[str, Any]  # a JSON Schema of the arguments
    timeout_secs: int


class TaskSpecApprovalAutoApprove(TypedDict, total=False):
    """The API's `TaskSpecApprovalAutoApprove`."""

    languages: list[str]
    executors: list[str]
    tools: list[str]


class TaskSpecApproval(TypedDict, total=False):
    """which blocks wait for a person (docs/approval.md); only tightens the operator's"""

    mode: Literal['never', 'policy', 'always']
    auto_approve: TaskSpecApprovalAutoApprove
    ask_tools: list[str]
    deny_tools: list[str]
    ask: list[ApprovalRule]
    ask_network: bool
    deny: list[ApprovalRule]
    timeout_secs: int


class _TaskSpecRequired(TypedDict):
    task: str


class TaskSpec(_TaskSpecRequired, total=False):
    """The API's `TaskSpec`."""

    executor: str
    model: str
    base_url: str
    max_turns: int
    max_input_tokens: int
    max_output_tokens: int
    max_cost: float
    output_schema: dict[str, Any]  # a JSON Schema the final answer ends with a value of
    traceparent: str  # the caller's span (W3C); the traceparent header wins
    timeout_secs: int
    block_timeout_secs: int
    system_prompt: str
    termination: str
    languages: list[str]
    limits: Limits
    team: TaskSpecTeam  # a team of agents; its fields are documented in docs/teams.md
    files: str  # the id of an upload whose files are placed in the workspace
    from_snapshot: str  # the id of a snapshot whose files are placed in the workspace, as an upload's are (not with files)
    volumes: list[VolumeMount]  # volumes mounted into the task's sandboxes (docs/volumes.md)
    keep_state: bool  # Python blocks share one interpreter (local and docker)
    placement: dict[str, str]  # labels the Docker host of the sandbox must carry (docs/docker-hosts.md)
    network: NetworkRequest
    code_via: Literal['blocks', 'tool', 'auto']  # how the model's code reaches the executor (docs/tools.md)
    candidates: int  # replies to choose among when one first fails the examples, the model's own with them (docs/eval.md)
    check: TaskSpecCheck  # decides whether the task was solved, run in its sandbox after it ends (docs/eval.md)
    tools: list[str | TaskSpecToolsItem2]  # tools offered to the model; left out, every tool the operator declares
    approval: TaskSpecApproval  # which blocks wait for a person (docs/approval.md); only tightens the operator's


class SessionSpec(TypedDict, total=False):
    """The API's `SessionSpec`."""

    executor: str
    keep_state: bool
    files: str  # the id of an upload whose files are placed in the workspace
    from_snapshot: str  # the id of a snapshot whose files are placed in the workspace (not with files)
    volumes: list[VolumeMount]  # volumes mounted into its sandbox (docs/volumes.md)
    limits: Limits
    idle_timeout_secs: int
    tools: list[ClientTool]
    network: NetworkRequest


class NetworkRequest(TypedDict, total=False):
    """the hosts the sandboxes may reach through the egress proxy (docs/network.md)"""

    allow: list[str]


class _ClientToolRequired(TypedDict):
    name: str


class ClientTool(_ClientToolRequired, total=False):
    """The API's `ClientTool`."""

    description: str


class _SessionInfoRequired(TypedDict):
    id: str
    executor: str
    keep_state: bool
    tools: list[str]
    busy: bool
    blocks: int
    created_ms: int
    idle_timeout_secs: int
    state: Literal['running', 'paused']


class SessionInfo(_SessionInfoRequired, total=False):
    """The API's `SessionInfo`."""

    pool_wait_ms: int  # how long its opening waited for a started sandbox from the warm pool (0: one was ready); absent when it started its own
    resources: Resources


class Resources(TypedDict, total=False):
    """what a block (or, summed, a session) used; a figure not measured is absent, never zero"""

    cpu_secs: float  # CPU time, user and system
    peak_memory_bytes: int
    peak_memory_scope: Literal['block', 'session']  # block: the block's own peak; session: the sandbox's peak so far
    disk_written_bytes: int  # bytes its processes caused to be written to storage
    net_bytes_in: int  # bytes received through the egress proxy
    net_bytes_out: int  # bytes sent through the egress proxy
    source: str  # cgroup v1, cgroup v2 or getrusage
    unavailable: str  # why a figure is missing


class _VolumeMountRequired(TypedDict):
    name: str  # the volume's name
    path: str  # where the sandbox sees it: inside the workspace (data), or absolute (/data) on docker


class VolumeMount(_VolumeMountRequired, total=False):
    """The API's `VolumeMount`."""

    read_only: bool


class _VolumeRequired(TypedDict):
    name: str
    created: str
    mounted_by: int  # sandboxes of this daemon that mount it now


class Volume(_VolumeRequired, total=False):
    """The API's `Volume`."""

    max_mb: int  # its quota in MiB
    used_bytes: int  # bytes its filesystem holds


class SnapshotNotSavedItem(TypedDict, total=False):
    """The API's `SnapshotNotSavedItem`."""

    name: str
    why: str


class SnapshotSource(TypedDict, total=False):
    """The API's `SnapshotSource`."""

    kind: Literal['session', 'task']
    id: str
    executor: str


class _SnapshotRequired(TypedDict):
    id: str
    bytes: int
    added_bytes: int
    files: int
    dirs: int
    saved: list[str]
    not_saved: list[SnapshotNotSavedItem]
    created_ms: int
    created: str
    source: SnapshotSource


class Snapshot(_SnapshotRequired, total=False):
    """The API's `Snapshot`."""

    name: str | None
    state_bytes: int


class SessionFiles(TypedDict):
    """The API's `SessionFiles`."""

    session: str
    files: list[FileInfo]


class _ExecSpecRequired(TypedDict):
    language: str
    code: str


class ExecSpec(_ExecSpecRequired, total=False):
    """The API's `ExecSpec`."""

    timeout_secs: float
    executor: str  # /v1/exec only
    files: str  # /v1/exec only: an upload's id
    network: NetworkRequest


class _BlockResultRequired(TypedDict):
    status: Literal['exited', 'timed_out', 'killed', 'out_of_memory', 'cancelled', 'unsupported', 'skipped', 'not_run', 'incomplete', 'declined', 'error']
    stdout: str
    stderr: str
    truncated: bool
    duration_ms: int


class BlockResult(_BlockResultRequired, total=False):
    """The API's `BlockResult`."""

    language: str | None
    exit_code: int | None
    resources: Resources


class ExecEventError(TypedDict):
    """The API's `ExecEventError`."""

    code: str
    message: str


class _ExecEventRequired(TypedDict):
    type: Literal['output', 'tool_call', 'net', 'result', 'error']


class ExecEvent(_ExecEventRequired, total=False):
    """The API's `ExecEvent`."""

    stream: Literal['stdout', 'stderr']
    text: str
    call: str
    name: str
    arguments: Any
    result: BlockResult
    error: ExecEventError


class ToolAnswer(TypedDict, total=False):
    """The API's `ToolAnswer`."""

    result: str
    error: str


class Limits(TypedDict, total=False):
    """The API's `Limits`."""

    memory_bytes: int
    cpu_secs: int
    file_size_bytes: int
    output_bytes: int


class Upload(TypedDict):
    """The API's `Upload`."""

    id: str
    files: list[FileInfo]
    bytes: int
    expires_ms: int


class _FileInfoRequired(TypedDict):
    path: str
    bytes: int


class FileInfo(_FileInfoRequired, total=False):
    """The API's `FileInfo`."""

    modified_ms: int
    given: bool


class ApprovalRule(TypedDict):
    """The API's `ApprovalRule`."""

    name: str
    pattern: str  # a regular expression searched for in the code


class TaskError(TypedDict, total=False):
    """The API's `TaskError`."""

    code: str
    message: str


class TaskBudget(TypedDict):
    """The API's `TaskBudget`."""

    budget: Literal['max_input_tokens', 'max_output_tokens', 'max_cost']
    limit: float
    spent: float


class TaskUsage(TypedDict, total=False):
    """The API's `TaskUsage`."""

    prompt_tokens: int
    completion_tokens: int


class _TaskCheckRequired(TypedDict):
    verdict: Literal['solved', 'unsolved', 'error']


class TaskCheck(_TaskCheckRequired, total=False):
    """The API's `TaskCheck`."""

    detail: str
    printed: bool  # with a value check: whether the code printed the value


class _TaskRequired(TypedDict):
    id: str
    state: Literal['queued', 'running', 'awaiting_approval', 'interrupted', 'finished']
    spec: TaskSpec
    usage: TaskUsage
    turns: int
    created_ms: int


class Task(_TaskRequired, total=False):
    """The API's `Task`."""

    stop_reason: Literal['terminated', 'answered', 'examples_held', 'max_turns', 'timeout', 'budget', 'cancelled', 'error', 'repeated']
    error: TaskError
    answer: str  # the model's final statement, else what its code last printed in a clean run
    answer_from: Literal['model', 'output']
    no_answer: str  # why the task has no answer
    cost: float
    trace_id: str  # the trace of the task's first run
    budget: TaskBudget
    started_ms: int
    finished_ms: int
    files_removed_ms: int
    result: Any  # the final answer: the value checked against output_schema, else the assistant's last reply without the termination word
    check: TaskCheck


# Every property each schema names, for checks.
FIELDS: dict[str, frozenset[str]] = {
    'ApprovalRule': frozenset(['name', 'pattern']),
    'BlockResult': frozenset(['duration_ms', 'exit_code', 'language', 'resources', 'status', 'stderr', 'stdout', 'truncated']),
    'ClientTool': frozenset(['description', 'name']),
    'ExecEvent': frozenset(['arguments', 'call', 'error', 'name', 'result', 'stream', 'text', 'type']),
    'ExecSpec': frozenset(['code', 'executor', 'files', 'language', 'network', 'timeout_secs']),
    'FileInfo': frozenset(['bytes', 'given', 'modified_ms', 'path']),
    'Limits': frozenset(['cpu_secs', 'file_size_bytes', 'memory_bytes', 'output_bytes']),
    'NetworkRequest': frozenset(['allow']),
    'Resources': frozenset(['cpu_secs', 'disk_written_bytes', 'net_bytes_in', 'net_bytes_out', 'peak_memory_bytes', 'peak_memory_scope', 'source', 'unavailable']),
    'SessionFiles': frozenset(['files', 'session']),
    'SessionInfo': frozenset(['blocks', 'busy', 'created_ms', 'executor', 'id', 'idle_timeout_secs', 'keep_state', 'pool_wait_ms', 'resources', 'state', 'tools']),
    'SessionSpec': frozenset(['executor', 'files', 'from_snapshot', 'idle_timeout_secs', 'keep_state', 'limits', 'network', 'tools', 'volumes']),
    'Snapshot': frozenset(['added_bytes', 'bytes', 'created', 'created_ms', 'dirs', 'files', 'id', 'name', 'not_saved', 'saved', 'source', 'state_bytes']),
    'Task': frozenset(['answer', 'answer_from', 'budget', 'check', 'cost', 'created_ms', 'error', 'files_removed_ms', 'finished_ms', 'id', 'no_answer', 'result', 'spec', 'started_ms', 'state', 'stop_reason', 'trace_id', 'turns', 'usage']),
    'TaskSpec': frozenset(['approval', 'base_url', 'block_timeout_secs', 'candidates', 'check', 'code_via', 'executor', 'files', 'from_snapshot', 'keep_state', 'languages', 'limits', 'max_cost', 'max_input_tokens', 'max_output_tokens', 'max_turns', 'model', 'network', 'output_schema', 'placement', 'system_prompt', 'task', 'team', 'termination', 'timeout_secs', 'tools', 'traceparent', 'volumes']),
    'ToolAnswer': frozenset(['error', 'result']),
    'Upload': frozenset(['bytes', 'expires_ms', 'files', 'id']),
    'Volume': frozenset(['created', 'max_mb', 'mounted_by', 'name', 'used_bytes']),
    'VolumeMount': frozenset(['name', 'path', 'read_only']),
}
