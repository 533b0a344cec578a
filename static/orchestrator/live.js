/* Live updates for the task list and the task page, over the websockets of
 * orchestrator/consumers.py. Plain JavaScript: no libraries, nothing from a CDN.
 *
 * The list page (`[data-live-list]`): /ws/tasks/ sends {"type": "state", "tasks": [...]} on
 * connect and {"type": "task", id, seq, status, steps_done, steps_total, progress_percent} on
 * each change; rows are updated in place, and new tasks are announced on the newest page.
 *
 * The task page (`[data-live-task]`): /ws/tasks/<id>/?resume_from=<last seq seen> sends a
 * `state`, then every event after that seq in order, then live events and throttled `state`
 * refreshes; {"type": "reload"} asks for a page reload. The initial seq comes from the
 * server-rendered page, so a page load followed by a connect has no gap; a reconnect resumes
 * from the last event seen.
 *
 * Control buttons are rendered by the server, for operators only, from engine/actions.py;
 * each `state` carries the same answer (`actions`: [{name, allowed, reason}], and
 * `controls_note`): this script hides and re-shows the controls (`[data-action=<name>]`)
 * from it, decides nothing itself, and never creates one.
 */
(function () {
  "use strict";

  var MIN_DELAY = 500;   // first reconnect delay (ms)
  var MAX_DELAY = 5000;  // reconnect delay cap (ms)

  // --- small helpers ---------------------------------------------------------------------
  function qs(selector, root) { return (root || document).querySelector(selector); }
  function qsa(selector, root) { return Array.prototype.slice.call((root || document).querySelectorAll(selector)); }
  function tid(name) { return '[data-testid="' + name + '"]'; }

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (key) {
      if (key === "text") node.textContent = attrs[key];
      else if (key === "className") node.className = attrs[key];
      else node.setAttribute(key, attrs[key]);
    });
    (children || []).forEach(function (child) { if (child) node.appendChild(child); });
    return node;
  }

  function setText(node, text) {
    text = String(text);
    if (node && node.textContent !== text) node.textContent = text;
  }

  function show(node, visible) {
    if (!node) return;
    node.hidden = !visible;
    node.style.display = visible ? "" : "none";
  }

  function replaceClass(node, prefix, value) {
    if (!node) return;
    var classes = node.className.split(/\s+/).filter(function (c) { return c && c.indexOf(prefix) !== 0; });
    classes.push(prefix + value);
    var next = classes.join(" ");
    if (node.className !== next) node.className = next;
  }

  function pad(n, width) { n = String(n); while (n.length < (width || 2)) n = "0" + n; return n; }

  // The server renders times in UTC (settings.TIME_ZONE); so do we.
  function parseTime(iso) { var d = iso ? new Date(iso) : null; return d && !isNaN(d.getTime()) ? d : null; }
  function hms(iso) {
    var d = parseTime(iso);
    return d ? pad(d.getUTCHours()) + ":" + pad(d.getUTCMinutes()) + ":" + pad(d.getUTCSeconds()) : "—";
  }
  function hmsMillis(iso) {
    var d = parseTime(iso);
    return d ? hms(iso) + "." + pad(d.getUTCMilliseconds(), 3) : "";
  }
  function dateTime(iso) {
    var d = parseTime(iso);
    return d ? d.getUTCFullYear() + "-" + pad(d.getUTCMonth() + 1) + "-" + pad(d.getUTCDate()) + " " + hms(iso) : "";
  }

  // Django's truncatechars: at most n characters, the last one an ellipsis.
  function truncate(text, n) { text = String(text || ""); return text.length > n ? text.slice(0, n - 1) + "…" : text; }

  // JSON like Python's json.dumps (", " and ": " separators), as the server renders payloads.
  function pyJson(value) {
    if (value === null || typeof value !== "object") return JSON.stringify(value);
    if (Array.isArray(value)) return "[" + value.map(pyJson).join(", ") + "]";
    return "{" + Object.keys(value).map(function (k) { return JSON.stringify(k) + ": " + pyJson(value[k]); }).join(", ") + "}";
  }

  function toInt(value, fallback) { var n = parseInt(value, 10); return isNaN(n) ? fallback : n; }

  // --- shared widgets --------------------------------------------------------------------
  function setStatusBadge(badge, status) {
    if (!badge || !status) return;
    setText(badge, status);
    badge.setAttribute("data-status", status);
    replaceClass(badge, "status-", status);
  }

  function setProgress(progress, done, total, percent, status) {
    if (!progress) return;
    progress.setAttribute("aria-valuenow", percent);
    progress.title = done + " of " + total + " steps";
    var bar = qs(".progress-bar", progress);
    if (bar) {
      if (bar.style.width !== percent + "%") bar.style.width = percent + "%";
      bar.setAttribute("data-percent", percent);
      if (status) replaceClass(bar, "status-bg-", status);
    }
    setText(qs(".progress-label", progress), done + "/" + total + " · " + percent + "%");
  }

  // --- the socket: reconnects with backoff, shows its state -------------------------------
  function LiveSocket(options) {
    this.url = options.url;            // function returning the ws URL (read at each connect)
    this.onMessage = options.onMessage;
    this.indicator = options.indicator;
    this.delay = MIN_DELAY;
    this.stopped = false;
    this.connect();
    var self = this;
    window.addEventListener("pagehide", function () { self.stop(); });
    window.addEventListener("pageshow", function (event) {
      if (event.persisted && self.stopped) {  // back from the bfcache
        self.stopped = false;
        self.delay = MIN_DELAY;
        self.connect();
      }
    });
  }

  // The server says the database is unreachable (or back): a banner, so nobody mistakes a
  // frozen page for a quiet one.
  function showOutage(down) {
    var banner = qs(tid("outage-banner"));
    if (banner) show(banner, down);
  }

  LiveSocket.prototype.setIndicator = function (state, text) {
    var node = this.indicator;
    if (!node) return;
    node.hidden = false;
    node.setAttribute("data-state", state);
    setText(node, text);
    node.title = state === "live" ? "Updates arrive live" : "Connection lost; reconnecting";
  };

  LiveSocket.prototype.connect = function () {
    if (this.stopped) return;
    var self = this;
    var scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
    var socket;
    try {
      socket = new WebSocket(scheme + window.location.host + this.url());
    } catch (err) {
      this.retry();
      return;
    }
    this.socket = socket;
    socket.onopen = function () { self.setIndicator("live", "live"); };
    socket.onmessage = function (message) {
      self.delay = MIN_DELAY;  // the server answered: the next drop starts the backoff afresh
      var data;
      try { data = JSON.parse(message.data); } catch (err) { return; }
      if (data && data.type === "reload") {
        self.stop();
        window.location.reload();
        return;
      }
      if (data && data.type === "outage") {
        showOutage(data.database === "unreachable");
        return;
      }
      try { self.onMessage(data); } catch (err) { if (window.console) console.error("live update failed", err); }
    };
    socket.onclose = function (event) {
      if (self.socket === socket) self.socket = null;
      if (event && event.code === 4503) showOutage(true);  // refused: the database is unreachable
      self.retry();
    };
  };

  LiveSocket.prototype.retry = function () {
    if (this.stopped) return;
    this.setIndicator("reconnecting", "reconnecting…");
    var self = this;
    var delay = this.delay;
    this.delay = Math.min(MAX_DELAY, this.delay * 2);
    clearTimeout(this.timer);
    this.timer = setTimeout(function () { self.connect(); }, delay);
  };

  LiveSocket.prototype.stop = function () {
    this.stopped = true;
    clearTimeout(this.timer);
    if (this.socket) { try { this.socket.close(); } catch (err) { /* already closed */ } }
  };

  // --- the task list -----------------------------------------------------------------------
  function initList(table) {
    var tbody = table.tBodies[0];
    var newest = table.getAttribute("data-live-newest") === "1";
    var apiTasks = table.getAttribute("data-api-tasks") || "/api/tasks";
    var rows = {};
    var maxId = 0;
    qsa("tr[data-task-id]", tbody).forEach(function (row) {
      var id = toInt(row.getAttribute("data-task-id"), 0);
      rows[id] = row;
      if (id > maxId) maxId = id;
    });
    var unseen = {};
    var notice = qs(tid("new-tasks-notice"));
    var reasonIds = {};
    var reasonTimer = null;

    function setReason(row, reason) {
      var cell = qs(tid("task-status"), row);
      cell = cell && cell.parentNode;
      if (!cell) return;
      var node = qs(".reason", cell);
      if (!reason) { if (node) node.parentNode.removeChild(node); return; }
      if (!node) { node = el("div", { className: "reason" }); cell.appendChild(node); }
      node.title = reason;
      setText(node, truncate(reason, 60));
    }

    function apply(row, task, reason) {
      var seq = toInt(task.seq, 0);
      var seen = toInt(row.getAttribute("data-seq"), 0);
      if (seq < seen) return;  // an older view than the row's
      var before = row.getAttribute("data-status");
      row.setAttribute("data-seq", seq);
      row.setAttribute("data-status", task.status);
      setStatusBadge(qs(tid("task-status"), row), task.status);
      setProgress(qs(tid("progress"), row), task.steps_done, task.steps_total, task.progress_percent, task.status);
      if (reason !== undefined) setReason(row, reason);
      else if (before !== task.status) refreshReason(task.id);
      var updated = qs('[data-live="updated"]', row);
      if (updated && seq > seen) {
        // `task` messages are news: "0 minutes ago"; a `state` summary carries updated_at.
        var at = parseTime(task.updated_at) || new Date();
        var minutes = Math.max(0, Math.floor((Date.now() - at.getTime()) / 60000));
        if (minutes < 60) {
          updated.title = at.toISOString();
          setText(updated, minutes + (minutes === 1 ? " minute" : " minutes") + " ago");
        }
      }
    }

    // `task` messages carry no status reason: fetch it (debounced) from the JSON API.
    function refreshReason(id) {
      reasonIds[id] = true;
      if (reasonTimer) return;
      reasonTimer = setTimeout(function () {
        reasonTimer = null;
        var ids = Object.keys(reasonIds).map(Number);
        reasonIds = {};
        var lo = Math.min.apply(null, ids), hi = Math.max.apply(null, ids);
        var ranges = hi - lo < 200 ? [[hi, hi - lo + 1]] : ids.map(function (i) { return [i, 1]; });
        ranges.forEach(function (range) {
          fetch(apiTasks + "?before=" + (range[0] + 1) + "&limit=" + range[1],
                { credentials: "same-origin", headers: { Accept: "application/json" } })
            .then(function (r) { return r.ok ? r.json() : null; })
            .then(function (page) {
              ((page && page.items) || []).forEach(function (item) {
                var row = rows[item.id];
                // Only when the row still shows that status: a newer change fetches again.
                if (row && row.getAttribute("data-status") === item.status) setReason(row, item.status_reason);
              });
            })
            .catch(function () { /* the next change tries again */ });
        });
      }, 300);
    }

    function noteNew(id) {
      if (!newest || id <= maxId || rows[id]) return;
      unseen[id] = true;
      var count = Object.keys(unseen).length;
      if (!notice) return;
      var link = qs("a", notice) || notice;
      setText(link, count + (count === 1 ? " new task" : " new tasks") + " — refresh");
      show(notice, true);
    }

    new LiveSocket({
      url: function () { return "/ws/tasks/"; },
      indicator: qs(tid("live-indicator")),
      onMessage: function (msg) {
        if (msg.type === "state") {
          (msg.tasks || []).forEach(function (task) {
            if (rows[task.id]) apply(rows[task.id], task, task.status_reason || "");
            else noteNew(task.id);
          });
        } else if (msg.type === "task") {
          if (rows[msg.id]) apply(rows[msg.id], msg);
          else noteNew(msg.id);
        }
      }
    });
  }

  // --- the task page -----------------------------------------------------------------------
  function initDetail(header) {
    var taskId = header.getAttribute("data-task-id");
    var lastSeq = toInt(header.getAttribute("data-seq"), 0);
    var stateSeq = 0;  // seq of the latest `state`: older events must not override it
    var stepsTable = qs(tid("steps-table"));
    var walTable = qs(tid("wal-table"));
    var eventsTable = qs(tid("events-table"));
    var maxSteps = toInt(stepsTable && stepsTable.getAttribute("data-max-rows"), 2000);
    var maxWal = toInt(walTable && walTable.getAttribute("data-max-rows"), 500);
    var maxEvents = toInt(eventsTable && eventsTable.getAttribute("data-max-rows"), 200);
    var heartbeat = null;  // {age, at}: the age reported and when it arrived

    // Events the server rendered after reading the task (a race) count as seen.
    qsa(tid("event-row"), eventsTable).forEach(function (row) {
      lastSeq = Math.max(lastSeq, toInt(row.getAttribute("data-seq"), 0));
    });

    function setCount(name, value) { setText(qs('[data-live="' + name + '"]'), value); }

    function removeEmpty(tbody) {
      qsa("td.empty", tbody).forEach(function (td) { tbody.removeChild(td.parentNode); });
    }

    // header: status, control request, reason -------------------------------------------
    function setStatus(status, reason, control) {
      setStatusBadge(qs(tid("task-status"), header), status);
      header.setAttribute("data-status", status);
      if (reason !== undefined) {
        var node = qs(tid("status-reason"), header);
        if (reason) {
          if (!node) {
            node = el("div", { className: "status-reason", "data-testid": "status-reason" });
            var sub = qs(".task-sub", header);
            header.insertBefore(node, sub ? sub.nextSibling : qs(tid("progress"), header));
          }
          setText(node, reason);
          show(node, true);
        } else if (node) {
          show(node, false);
        }
      }
      if (control !== undefined) {
        header.setAttribute("data-control", control || "");
        var badge = qs(tid("task-control"), header);
        if (control) {
          if (!badge) {
            badge = el("span", { className: "badge badge-outline", "data-testid": "task-control" });
            var status = qs(tid("task-status"), header);
            status.parentNode.insertBefore(badge, status.nextSibling);
          }
          setText(badge, control + " requested");
          show(badge, true);
        } else if (badge) {
          show(badge, false);
        }
      }
    }

    // Show the server-rendered controls the server allows now, hide the others (the page's
    // [data-action] elements: the controls box and the snapshots' rollback buttons). An
    // allowed control the page was rendered without (e.g. Skip step, whose form lists the
    // steps) asks for a reload.
    function updateControls(actions, controlsNote, status) {
      var box = qs(tid("controls"), header);
      if (!box || !actions) return;  // not an operator: no controls were rendered
      var missing = false;
      actions.forEach(function (action) {
        var nodes = qsa('[data-action="' + action.name + '"]');
        if (!nodes.length && action.allowed) missing = true;
        nodes.forEach(function (node) { show(node, action.allowed); });
      });
      // What the last `state` allowed (read by the tests).
      box.setAttribute("data-live-actions", actions.filter(function (a) { return a.allowed; })
        .map(function (a) { return a.name; }).join(" "));
      var note = qs('[data-live="controls-note"]', box);
      if (!note) {
        note = el("span", { className: "muted small", "data-live": "controls-note" });
        box.appendChild(note);
      }
      if (missing) {
        note.textContent = "";
        note.appendChild(document.createTextNode("The task is " + status + ": "));
        note.appendChild(el("a", { href: window.location.pathname, text: "reload for its controls" }));
        note.appendChild(document.createTextNode("."));
      } else {
        setText(note, controlsNote || "");
      }
      show(note, missing || !!controlsNote);
    }

    // steps ------------------------------------------------------------------------------
    function stepCells(step) {
      return {
        status: step.status,
        attempts: String(step.attempts),
        started: hms(step.started_at),
        finished: hms(step.finished_at),
        duration: step.duration_seconds === null || step.duration_seconds === undefined
          ? "—" : Number(step.duration_seconds).toFixed(2) + " s"
      };
    }

    function errorCell(td, error) {
      var pre = qs("pre", td);
      if (!error) { if (pre) td.textContent = ""; return; }
      // The state carries a truncated error: keep a longer one the server rendered.
      if (pre && pre.textContent.indexOf(error) === 0) return;
      td.textContent = "";
      td.appendChild(el("details", {}, [el("summary", { className: "text-error", text: "error" }),
                                        el("pre", { text: error })]));
    }

    function updateStepRow(row, step) {
      var cells = stepCells(step);
      row.setAttribute("data-status", step.status);
      var badge = qs(tid("step-status"), row);
      setText(badge, step.status);
      replaceClass(badge, "step-", step.status);
      setText(qs('[data-col="attempts"]', row), cells.attempts);
      setText(qs('[data-col="started"]', row), cells.started);
      setText(qs('[data-col="finished"]', row), cells.finished);
      setText(qs('[data-col="duration"]', row), cells.duration);
      errorCell(qs('[data-col="error"]', row), step.error);
    }

    function buildStepRow(step, position) {
      var row = el("tr", { "data-testid": "step-row", "data-step-id": step.id, "data-status": step.status }, [
        el("td", { className: "num", text: String(position) }),
        el("td", { className: "mono", text: step.id }),
        el("td", { text: step.title || "" }),
        el("td", {}, [el("span", { className: "badge step-" + step.status, "data-testid": "step-status" })]),
        el("td", { className: "num", "data-col": "attempts" }),
        el("td", { className: "nowrap", "data-col": "started" }),
        el("td", { className: "nowrap", "data-col": "finished" }),
        el("td", { className: "num", "data-col": "duration" }),
        el("td", { className: "mono small muted", text: "" }),
        el("td", { className: "mono small muted", text: "" }),
        el("td", { "data-col": "error" })
      ]);
      updateStepRow(row, step);
      return row;
    }

    function updateSteps(steps) {
      if (!stepsTable || !steps) return;
      var tbody = stepsTable.tBodies[0];
      var existing = {};
      qsa("tr[data-step-id]", tbody).forEach(function (row) { existing[row.getAttribute("data-step-id")] = row; });
      var count = Object.keys(existing).length;
      var previous = null;
      steps.forEach(function (step, index) {
        var row = existing[step.id];
        if (row) {
          updateStepRow(row, step);
        } else {
          if (count >= maxSteps) return;
          if (count === 0) removeEmpty(tbody);
          row = buildStepRow(step, index);
          tbody.insertBefore(row, previous ? previous.nextSibling : tbody.firstChild);
          count += 1;
        }
        previous = row;
      });
      setCount("steps-count", steps.length);
    }

    // the write-ahead log (newest first) ----------------------------------------------------
    function updateWalRow(row, entry) {
      row.setAttribute("data-status", entry.status);
      var badge = qs('[data-col="status"] .badge', row);
      setText(badge, entry.status);
      replaceClass(badge, "wal-", entry.status);
      setText(qs('[data-col="completed"]', row), hms(entry.completed_at));
      errorCell(qs('[data-col="error"]', row), entry.error);
    }

    function buildWalRow(entry) {
      var row = el("tr", { "data-testid": "wal-row", "data-wal-id": String(entry.id), "data-status": entry.status }, [
        el("td", { className: "num", text: String(entry.id) }),
        el("td", { className: "mono", text: entry.step_id }),
        el("td", { className: "mono", text: entry.tool }),
        el("td", { className: "mono small", text: entry.idempotency_key }),
        el("td", { className: "muted", text: "—" }),
        el("td", { "data-col": "status" }, [el("span", { className: "badge wal-" + entry.status })]),
        el("td", { className: "nowrap", text: hms(entry.created_at) }),
        el("td", { className: "nowrap", "data-col": "completed" }),
        el("td", { "data-col": "error" })
      ]);
      updateWalRow(row, entry);
      return row;
    }

    function updateWal(entries) {
      if (!walTable || !entries) return;
      var tbody = walTable.tBodies[0];
      var existing = {};
      var rows = qsa("tr[data-wal-id]", tbody);
      rows.forEach(function (row) { existing[row.getAttribute("data-wal-id")] = row; });
      var added = 0;
      // entries are newest first; insert each before the first row with a smaller id
      entries.slice().reverse().forEach(function (entry) {
        var row = existing[String(entry.id)];
        if (row) { updateWalRow(row, entry); return; }
        if (rows.length === 0 && added === 0) removeEmpty(tbody);
        row = buildWalRow(entry);
        var before = null;
        qsa("tr[data-wal-id]", tbody).some(function (other) {
          if (toInt(other.getAttribute("data-wal-id"), 0) < entry.id) { before = other; return true; }
          return false;
        });
        tbody.insertBefore(row, before);
        existing[String(entry.id)] = row;
        added += 1;
      });
      if (added) {
        var all = qsa("tr[data-wal-id]", tbody);
        for (var i = maxWal; i < all.length; i++) tbody.removeChild(all[i]);
        var countNode = qs('[data-live="wal-count"]');
        if (countNode) setText(countNode, toInt(countNode.textContent, 0) + added);
      }
    }

    // events (newest first) -----------------------------------------------------------------
    function appendEvent(event) {
      setCount("events-count", lastSeq);
      setCount("events-counter", lastSeq);
      if (!eventsTable) return;
      var tbody = eventsTable.tBodies[0];
      if (qs('tr[data-seq="' + event.seq + '"]', tbody)) return;
      removeEmpty(tbody);
      var row = el("tr", { "data-testid": "event-row", "data-seq": String(event.seq), className: "live-new" }, [
        el("td", { className: "num", text: String(event.seq) }),
        el("td", { className: "mono", text: event.kind }),
        el("td", { className: "mono small payload", text: truncate(pyJson(event.payload), 400) }),
        el("td", { className: "nowrap", text: hmsMillis(event.created_at) })
      ]);
      var before = null;
      qsa(tid("event-row"), tbody).some(function (other) {
        if (toInt(other.getAttribute("data-seq"), 0) < event.seq) { before = other; return true; }
        return false;
      });
      tbody.insertBefore(row, before);
      var all = qsa(tid("event-row"), tbody);
      for (var i = maxEvents; i < all.length; i++) tbody.removeChild(all[i]);
    }

    // counters and worker -------------------------------------------------------------------
    function renderHeartbeat() {
      var node = qs('[data-live="heartbeat"]');
      if (!node || !heartbeat) return;
      var age = heartbeat.age + (Date.now() - heartbeat.at) / 1000;
      var span = qs(tid("heartbeat-age"), node);
      if (!span) {
        node.textContent = "";
        span = el("span", { "data-testid": "heartbeat-age" });
        node.appendChild(span);
        node.appendChild(document.createTextNode(" s ago"));
      }
      setText(span, age.toFixed(1));
    }

    function applyState(state) {
      stateSeq = toInt(state.seq, 0);
      setStatus(state.status, state.status_reason || "", state.control || "");
      updateControls(state.actions, state.controls_note, state.status);
      setProgress(qs(tid("progress"), header), state.steps_done, state.steps_total, state.progress_percent, state.status);
      setCount("steps", state.steps_done + " / " + state.steps_total);
      setCount("tokens", state.tokens_used);
      setCount("active-seconds", Number(state.active_seconds || 0).toFixed(1));
      setCount("recovery-attempts", state.recovery_attempts);
      setCount("checkpoint", "v" + state.checkpoint_version);
      setCount("events-counter", Math.max(stateSeq, lastSeq));
      setCount("events-count", Math.max(stateSeq, lastSeq));
      if (state.updated_at) setCount("updated-at", dateTime(state.updated_at));
      if (state.worker) {
        setCount("worker", (state.worker.host || "?") + ":" + (state.worker.pid || "?"));
      } else {
        setCount("lease", "—");  // no lease holder (finished, queued or paused)
      }
      if (state.heartbeat_age !== null && state.heartbeat_age !== undefined) {
        heartbeat = { age: Number(state.heartbeat_age), at: Date.now() };
        renderHeartbeat();
      }
      updateSteps(state.steps);
      updateWal(state.wal);
      renderActivities(state.activities || []);
    }

    // What is still winding down after Stop/Pause/Terminate (empty otherwise).
    function renderActivities(activities) {
      var card = qs('[data-live="activities-card"]');
      var list = qs('[data-live="activities"]');
      if (!card || !list) return;
      while (list.firstChild) list.removeChild(list.firstChild);
      var now = Date.now() / 1000;
      activities.forEach(function (a) {
        var since = a.since ? " — for " + Math.max(0, now - a.since).toFixed(1) + " s" : "";
        list.appendChild(el("li", {}, [el("span", { "class": "mono" }, [document.createTextNode(a.kind)]),
                                       document.createTextNode(" " + a.label + since)]));
      });
      card.hidden = activities.length === 0;
    }

    // Events move the page at once; the next (throttled) `state` fills in the rest.
    function applyEvent(event) {
      var payload = event.payload || {};
      if (event.kind === "status" && payload.to) {
        setStatus(payload.to, payload.reason || "");
      } else if (event.kind === "step_done" || event.kind === "step_failed") {
        var row = stepsTable && qs('tr[data-step-id="' + String(payload.step).replace(/["\\]/g, "\\$&") + '"]', stepsTable);
        var status = event.kind === "step_done" ? "done" : (payload.retrying ? "pending" : "failed");
        if (row) {
          row.setAttribute("data-status", status);
          var badge = qs(tid("step-status"), row);
          setText(badge, status);
          replaceClass(badge, "step-", status);
        }
        if (event.kind === "step_done" && payload.steps_total) {
          var percent = Math.floor(100 * payload.steps_done / payload.steps_total);
          setProgress(qs(tid("progress"), header), payload.steps_done, payload.steps_total, percent,
                      header.getAttribute("data-status"));
          setCount("steps", payload.steps_done + " / " + payload.steps_total);
          if (payload.version !== undefined) setCount("checkpoint", "v" + payload.version);
        }
      }
    }

    setInterval(renderHeartbeat, 1000);

    new LiveSocket({
      url: function () { return "/ws/tasks/" + encodeURIComponent(taskId) + "/?resume_from=" + lastSeq; },
      indicator: qs(tid("live-indicator")),
      onMessage: function (msg) {
        if (msg.type === "state") {
          applyState(msg);
        } else if (msg.type === "event") {
          if (msg.seq <= lastSeq) return;  // already shown
          lastSeq = msg.seq;
          header.setAttribute("data-seq", lastSeq);
          appendEvent(msg);
          if (msg.seq > stateSeq) applyEvent(msg);  // not older than the last `state`
        }
      }
    });
  }

  function init() {
    if (!("WebSocket" in window)) return;
    var list = qs("[data-live-list]");
    if (list) initList(list);
    var header = qs("[data-live-task]");
    if (header) initDetail(header);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
