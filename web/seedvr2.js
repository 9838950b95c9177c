// The SeedVR2 pack's editor extension (served by ComfyUI from WEB_DIRECTORY).
//
// * A freshly added upscaler's seed starts "fixed": the editor's default, "randomize", would
//   change the seed after every run, so ComfyUI could never reuse a finished upscale.
//   Saved workflows keep what they saved (the value is set before the node is configured).
// * The model dropdowns label the released files that are not downloaded yet, with their
//   approximate size: the node's spec lists them under "seedvr2_downloads".
import { app } from "../../scripts/app.js";

const UPSCALERS = new Set(["SeedVR2VideoUpscaler", "SeedVR2UpscaleVideoFile"]);
const LOADERS = new Set(["SeedVR2LoadDiTModel", "SeedVR2LoadVAEModel"]);
const DOWNLOADS_KEY = "seedvr2_downloads";

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

app.registerExtension({
  name: "SeedVR2.Editor",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!LOADERS.has(nodeData.name)) return;
    const spec = nodeData.input?.required?.model;
    const downloads = (spec && spec[1] && spec[1][DOWNLOADS_KEY]) || {};
    const created = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = created?.apply(this, arguments);
      const widget = this.widgets?.find((w) => w.name === "model");
      if (widget) widget.options.getOptionLabel = downloadLabel(downloads);
      return result;
    };
  },
  nodeCreated(node) {
    if (!UPSCALERS.has(node.comfyClass)) return;
    const control = node.widgets?.find((w) => w.name === "control_after_generate");
    if (control) control.value = "fixed";
  },
});
