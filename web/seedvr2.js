// The SeedVR2 pack's editor extension (served by ComfyUI from WEB_DIRECTORY).
//
// It touches this pack's nodes only, by their exact IDs (OUR_NODES): other packs' nodes and
// ComfyUI's own native SeedVR2 nodes (SeedVR2Preprocess, SeedVR2Conditioning, ...) are left as
// they are.
// * Workflows saved with the numz pack: four of our node IDs are numz's, with another layout,
//   and the editor puts saved widget values on widgets by position. Before the editor builds a
//   loaded workflow's graph, one with any of those four node types (NUMZ_NODES, in the graph or
//   a subgraph definition) goes to the pack's server route, which rewrites numz-layout nodes to
//   ours (seedvr2.workflow.numz: every value on the input of the same meaning); what has no
//   place here is listed in a notice and in the browser console. The reply replaces the
//   workflow only when the route changed something: the JSON round trip would turn
//   non-finite numbers into null. Current editors (frontend 1.58) build the subgraphs of a
//   workflow (useSubgraphService().loadSubgraphs) before beforeConfigureGraph and build them
//   again from definitions.subgraphs when the graph is configured, after it: the rewrite,
//   made in place on that object, reaches them (tests/test_browser.py checks it).
// * A seed's "control after generate" starts at the mode the node's spec gives ("fixed", under
//   "seedvr2_control_mode"): current ComfyUI declares it as control_after_generate itself, but
//   older editors read a string there as the widget's name, get true and start at "randomize".
// * The model dropdowns label the released files that are not downloaded yet, with their
//   approximate size: the node's spec lists them under "seedvr2_downloads".
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

// seedvr2.workflow.nodes.build_nodes() and seedvr2.workflow.numz.NUMZ_NODES (tests check both).
const OUR_NODES = new Set(["SeedVR2LoadDiTModel", "SeedVR2LoadVAEModel",
  "SeedVR2TorchCompileSettings", "SeedVR2VideoUpscaler", "SeedVR2UpscaleVideoFile",
  "SeedVR2UpscaleVideo"]);
const NUMZ_NODES = new Set(["SeedVR2LoadDiTModel", "SeedVR2LoadVAEModel",
  "SeedVR2TorchCompileSettings", "SeedVR2VideoUpscaler"]);
const LOADERS = new Set(["SeedVR2LoadDiTModel", "SeedVR2LoadVAEModel"]);
const DOWNLOADS_KEY = "seedvr2_downloads";
const NUMZ_WORKFLOW_ROUTE = "/seedvr2/numz_workflow";
const CONTROL_MODE_KEY = "seedvr2_control_mode";
const CONTROL_MODES = new Set(["fixed", "increment", "decrement", "randomize"]);

// The registry's sizes are estimates (parameter count x storage format): "about".
function formatSize(bytes) {
  if (bytes === null || bytes === undefined) return "download";
  const gb = bytes / 1e9;
  return gb >= 1 ? `download, about ${gb.toFixed(1)} GB`
                 : `download, about ${Math.round(bytes / 1e6)} MB`;
}

function downloadLabel(downloads) {
  return (value) => {
    if (value === null || value === undefined) return "";
    return Object.prototype.hasOwnProperty.call(downloads, value)
      ? `${value}  (${formatSize(downloads[value])})`
      : String(value);
  };
}

function hasNumzNodeTypes(workflow) {
  const graphs = [workflow, ...(workflow?.definitions?.subgraphs ?? [])];
  return graphs.some((g) => (g?.nodes ?? []).some((n) => NUMZ_NODES.has(n?.type)));
}

// The INT inputs whose spec declares the mode their control widget starts at.
function declaredControls(nodeData) {
  const found = [];
  for (const section of ["required", "optional"]) {
    for (const [name, spec] of Object.entries(nodeData.input?.[section] ?? {})) {
      const mode = spec?.[1]?.[CONTROL_MODE_KEY];
      if (CONTROL_MODES.has(mode)) found.push([name, mode]);
    }
  }
  return found;
}

app.registerExtension({
  name: "SeedVR2.Editor",
  async beforeConfigureGraph(workflow) {
    if (!hasNumzNodeTypes(workflow)) return;
    const sent = JSON.stringify(workflow);
    let reply;
    try {
      const response = await api.fetchApi(NUMZ_WORKFLOW_ROUTE, {
        method: "POST", headers: { "Content-Type": "application/json" }, body: sent });
      if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
      reply = await response.json();
    } catch (error) {
      console.warn("SeedVR2: could not check the workflow for numz-layout nodes:", error);
      return;
    }
    if (JSON.stringify(reply.workflow) === sent) return;  // nothing in numz's layout
    // The editor goes on with this object: rewritten in place.
    for (const key of Object.keys(workflow)) delete workflow[key];
    Object.assign(workflow, reply.workflow);
    if (reply.notes?.length) {
      for (const note of reply.notes) console.warn(`SeedVR2: ${note}`);
      app.extensionManager?.toast?.add({
        severity: "warn", summary: "SeedVR2: opened a numz workflow",
        detail: reply.notes.join("\n"), life: 15000 });
    }
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!OUR_NODES.has(nodeData.name)) return;  // our nodes only
    const controls = declaredControls(nodeData);
    const isLoader = LOADERS.has(nodeData.name);
    if (!controls.length && !isLoader) return;
    const spec = nodeData.input?.required?.model;
    const downloads = (spec && spec[1] && spec[1][DOWNLOADS_KEY]) || {};
    const created = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = created?.apply(this, arguments);
      if (isLoader) {
        const widget = this.widgets?.find((w) => w.name === "model");
        if (widget) widget.options.getOptionLabel = downloadLabel(downloads);
      }
      // Before a saved workflow's values are set: those keep what they saved.
      for (const [name, mode] of controls) {
        const control = this.widgets?.find((w) => w.name === name)?.linkedWidgets?.[0];
        if (control && CONTROL_MODES.has(control.value)) control.value = mode;
      }
      return result;
    };
  },
});
