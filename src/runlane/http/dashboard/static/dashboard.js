// runlane dashboard: live updates over the API's event stream (/v1/events), which
// the browser's session cookie authenticates. Plain JavaScript, no build step, no
// inline code (the Content-Security-Policy allows scripts from /static only).
(function () {
  "use strict";

  function statusClass(status) {
    if (status === "SUCCEEDED") return "ok";
    if (["FAILED", "POLICY_DENIED", "STALE_LEASE"].indexOf(status) >= 0) return "bad";
    if (["CANCELLED", "CANCEL_REQUESTED", "CANCELLING"].indexOf(status) >= 0) return "off";
    if (["QUEUED", "ADMITTED", "WAITING_CAPACITY", "FAILED_RETRYABLE"].indexOf(status) >= 0) {
      return "wait";
    }
    return "run";
  }

  function setBadge(badge, status) {
    if (!badge) return;
    badge.textContent = status;
    badge.className = "badge " + statusClass(status);
  }

  var body = document.body;
  var page = body.dataset.page;
  if ((page !== "runs" && page !== "run") || !window.EventSource) return;

  var pending = {};

  // A run the page does not show yet: its row, rendered by the server, goes on top
  // when it matches the page's filters (the first page only: newest first).
  function insertRow(runId) {
    if (pending[runId]) return;
    pending[runId] = true;
    fetch("/runs/" + encodeURIComponent(runId) + "/row", {credentials: "same-origin"})
      .then(function (response) { return response.ok ? response.text() : ""; })
      .then(function (html) {
        if (!html || document.getElementById("run-" + runId)) return;
        var holder = document.createElement("template");
        holder.innerHTML = html;
        var row = holder.content.querySelector("tr[data-run]");
        if (!row) return;
        var queue = body.dataset.filterQueue, repo = body.dataset.filterRepo;
        if (queue && row.dataset.queue !== queue) return;
        if (repo && row.dataset.repo.indexOf(repo) < 0) return;
        row.classList.add("fresh");
        var tbody = document.getElementById("runs-body");
        tbody.insertBefore(row, tbody.firstChild);
        var empty = document.getElementById("runs-empty");
        if (empty) empty.hidden = true;
      })
      .catch(function () { /* the next event or a reload shows it */ })
      .then(function () { delete pending[runId]; });
  }

  function onRunsEvent(ev) {
    var row = document.getElementById("run-" + ev.run_id);
    if (row) {
      row.dataset.status = ev.to_status;
      setBadge(row.querySelector("[data-field=status]"), ev.to_status);
      return;
    }
    if (!body.dataset.firstPage) return;
    var status = body.dataset.filterStatus, tenant = body.dataset.filterTenant;
    if (status && ev.to_status !== status) return;
    if (tenant && ev.tenant !== tenant) return;
    insertRow(ev.run_id);
  }

  function onRunEvent(ev) {
    if (ev.run_id !== body.dataset.run) return;
    setBadge(document.getElementById("run-status"), ev.to_status);
    var changed = document.getElementById("changed");
    if (changed) changed.hidden = false;
  }

  var url = "/v1/events";
  if (body.dataset.eventsAfter) url += "?after=" + encodeURIComponent(body.dataset.eventsAfter);
  var source = new EventSource(url);
  var live = document.getElementById("live");
  source.onopen = function () { if (live) live.hidden = false; };
  source.onerror = function () { if (live) live.hidden = true; };
  source.onmessage = function (message) {
    var ev;
    try { ev = JSON.parse(message.data); } catch (e) { return; }
    if (page === "runs") onRunsEvent(ev); else onRunEvent(ev);
  };
  window.addEventListener("pagehide", function () { source.close(); });
})();
