// Validates the Deployments, Services and HorizontalPodAutoscalers of the
// YAML files given against Kubernetes' own OpenAPI schemas, as npm's
// kubernetes-models bundles them (types, required fields, enumerations; not
// unknown fields, which the schemas allow). Prints one line a document;
// exits 1 when one is invalid, 2 when a file holds none of these kinds.
// NODE_PATH names the node_modules holding kubernetes-models and js-yaml.
"use strict";
const fs = require("fs");
const yaml = require("js-yaml");
const { Deployment } = require("kubernetes-models/apps/v1");
const { Service } = require("kubernetes-models/v1");
const { HorizontalPodAutoscaler } = require("kubernetes-models/autoscaling/v2");

const models = {
  "apps/v1 Deployment": Deployment,
  "v1 Service": Service,
  "autoscaling/v2 HorizontalPodAutoscaler": HorizontalPodAutoscaler,
};
let invalid = 0;
let checked = 0;
for (const file of process.argv.slice(2)) {
  for (const doc of yaml.loadAll(fs.readFileSync(file, "utf8"))) {
    if (!doc) continue;
    const key = `${doc.apiVersion} ${doc.kind}`;
    const Model = models[key];
    if (!Model) continue;
    checked++;
    try {
      new Model(doc).validate();
      console.log(`valid: ${file}: ${key} ${doc.metadata.name}`);
    } catch (e) {
      invalid++;
      console.log(`INVALID: ${file}: ${key} ${doc.metadata && doc.metadata.name}: ${e.message}`);
    }
  }
}
if (checked === 0) {
  console.log("no Deployment, Service or HorizontalPodAutoscaler in the files given");
  process.exit(2);
}
process.exit(invalid ? 1 : 0);
